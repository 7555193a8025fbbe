"""The sandbox runtime: rootless Podman with gVisor's runsc, no network, read-only root.

Sandboxes start from the podman command line: runsc needs per-container runtime flags
(network=none, ignore-cgroups) that the REST API cannot carry (podman-py's and docker-py's
per-call runtime choice is ignored by the service), and the job must start inside the job's
cgroup, which only a process we launch ourselves can do. Everything else (inspecting,
signalling, removing, sweeping by label, images) goes through `ops` (podman_ops.py): podman-py
on the agent's own API service, or the command line where that cannot start. The guard that
removes a sandbox if the agent dies runs the command line: the service dies with the agent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from campugrid.protocol.errors import SandboxError
from campugrid.sandbox import limits as host_limits
from campugrid.sandbox import podman_ops, profile
from campugrid.sandbox import process as procs
from campugrid.sandbox.process import Finished, Interactive, LogFn, run_streaming
from campugrid.sandbox.runtime import DATA_MOUNT, OUTPUT_MOUNT, RunRequest, RunResult

# network=none: no network stack at all. ignore-cgroups: the agent writes the job's cgroup
# limits itself (cgroup v1, rootless). overlay2=none: writes reach the container's own
# rootfs, where the build commits them and the disk bound counts them; runsc's default since
# 2023 (root:self) keeps them in a hidden file that a build would commit whole.
RUNSC_FLAGS = ("--runtime-flag", "network=none", "--runtime-flag", "ignore-cgroups",
               "--runtime-flag", "overlay2=none")
AGENT_LABEL = "campugrid.agent"
HOST_PIDS_CEILING = 4096  # gVisor's own threads count on the host: keep it generous
GUEST_NPROC = 512  # enforced cleanly inside gVisor: fork() gets EAGAIN
PODMAN_OWN_EXITS = (125, 126, 127)  # podman's own failures (also what a job may exit with)
LOAD_FAILED = "failed to load"  # runsc's words for a command missing from the image


class PodmanRunsc:
    """The Runtime (campugrid.sandbox.runtime) on rootless Podman with gVisor's runsc."""

    name = "podman-runsc"

    def __init__(self, podman: str = "podman", runsc: str = "runsc", scope: str = "",
                 ops: podman_ops.PodmanOps | None = None) -> None:
        self.podman = shutil.which(podman) or podman
        self.runsc = shutil.which(runsc) or runsc
        self.limits = host_limits.detect()
        self.scope = scope  # this agent's folder of job cgroups (see limits.job_cgroup)
        self.seccomp = profile.write_profile(runtime_dir() / "campugrid" / "seccomp.json")
        self._ops = ops

    @property
    def ops(self) -> podman_ops.PodmanOps:
        """The API service, started at the first question (or the command line)."""
        if self._ops is None:
            self._ops = podman_ops.connect(runtime_dir(), self.podman)
        return self._ops

    def close(self) -> None:
        if isinstance(self._ops, podman_ops.ApiOps):
            self._ops.close()
        self._ops = None

    def describe(self) -> str:
        try:
            out = subprocess.run([self.runsc, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
        except OSError as e:
            raise SandboxError(f"runsc is not installed ({e}); apt-get install runsc") from e
        first = out.splitlines()[0] if out else "runsc"
        return first.replace("runsc version", "runsc").strip()

    def gpu_isolation_note(self) -> str:
        return nvproxy_support(self.runsc)

    def argv(self, req: RunRequest, *, interactive: bool = False) -> list[str]:
        gpu_flags = ["--runtime-flag", "nvproxy=true"] if req.gpus else []
        seccomp = [*profile.RUNTIME_FLAGS] if self.seccomp else []
        args = [
            self.podman, "--runtime", self.runsc, *RUNSC_FLAGS, *gpu_flags, *seccomp, "run",
            # A run's container stays until stop() removes it (and the guard, if the agent
            # dies), so that its State can be read first; a warm session's needs no State and
            # goes with its process (--rm), whatever happens to the agent.
            *(["--interactive", "--rm"] if interactive else []),
            "--name", req.name, "--pull", "never",
            "--network", "none",
            "--read-only", "--read-only-tmpfs=false",
            "--tmpfs", f"/tmp:rw,size={req.tmp_mb}m,mode=1777",
            # Rootless Podman's own user namespace: the container's root is the provider's
            # uid on the host (and every other uid one of its subordinate ids), without a
            # capability. `keep-id` (the provider's uid inside too) made Podman write an
            # ID-mapped copy of the whole image at its first start (docs/builds.md).
            "--userns", "host", "--user", "0:0",
            "--cap-drop", "all", "--security-opt", "no-new-privileges",
            *(["--security-opt", f"seccomp={self.seccomp}"] if self.seccomp else []),
            "--ulimit", f"nproc={GUEST_NPROC}:{GUEST_NPROC}",
            "--ulimit", "nofile=1024:1024",
            *(["--ulimit", f"fsize={req.file_mb * 1024 * 1024}"] if req.file_mb else []),
            "--timeout", str(req.wall_time_s + 5),  # podman's own backstop to ours
            "--log-opt", "max-size=20mb",
            "--label", f"{AGENT_LABEL}={req.agent}",
        ]
        if self.limits.v1_delegated is None:
            # Asked for where it may hold (cgroup v2); reported as not enforced otherwise.
            args += ["--memory", f"{req.memory_mb}m"] if _cgroup_v2() else []
        if req.output_dir is not None:
            args += ["-v", f"{req.output_dir}:{OUTPUT_MOUNT}:rw"]
        if req.data_dir is not None:
            args += ["-v", f"{req.data_dir}:{DATA_MOUNT}:ro"]
        for host, target, mode in req.mounts:
            args += ["-v", f"{host}:{target}:{'ro' if mode == 'ro' else 'rw'}"]
        args += gpu_devices(req.gpus)
        for k, v in req.env:
            args += ["--env", f"{k}={v}"]
        args.append(req.image)
        if req.command is not None:
            args += list(req.command)
        return args

    def run(self, req: RunRequest, *, log: LogFn,
            cancel: threading.Event | None = None) -> RunResult:
        if shutil.which(self.runsc) is None and not Path(self.runsc).exists():
            raise SandboxError("runsc (gVisor) is not installed; jobs never run without it")
        began = time.time()
        with host_limits.job_cgroup(self.limits, req.name, memory_mb=req.memory_mb,
                                    cpus=req.cpus, pids=HOST_PIDS_CEILING,
                                    scope=self.scope) as cg:
            done = run_streaming(
                host_limits.launcher(cg, self.argv(req)),
                log=log,
                timeout_s=req.wall_time_s,
                cancel=cancel,
                on_stop=lambda: self.halt(req.name),
                # If the agent dies (kill -9, OOM), the sandbox must not compute on unwatched.
                on_orphan=self.stop_argv(req.name),
                cgroups=cg.paths if cg is not None else (),
            )
            oom = done.returncode != 0 and cg is not None and cg.oom_killed()
        # No container at all: podman never made it (the agent alone removes them).
        started = podman_ops.started_at(self.ops.state(req.name) or {})
        self.stop(req.name)  # also when podman itself died: nothing of the job may stay
        failure = self._start_failure(done, started)
        if failure is not None:
            raise failure
        # The kernel's OOM killer may take the sentry or the gofer rather than the job's
        # process, and runsc then exits 1: report what a killed container reports, 137.
        code = 128 + signal.SIGKILL if oom else done.returncode
        return RunResult(code, done.timed_out, done.cancelled, oom, done.tail,
                         self.limits.as_dict(),
                         started - began if isinstance(started, float) else None)

    @staticmethod
    def _start_failure(done: Finished, started: float | bool | None) -> SandboxError | None:
        """Podman's own failure to make or start the sandbox (exit 125-127, as a job's own
        command may also exit), told apart by whether the container ever started: its State
        is the evidence. A command missing from the image stays the job's fault."""
        if done.returncode not in PODMAN_OWN_EXITS or done.timed_out or done.cancelled:
            return None
        if LOAD_FAILED in done.tail or started is not False:
            return None
        return SandboxError(f"podman could not start the sandbox (exit {done.returncode})",
                            exit_code=done.returncode, stderr_tail=done.tail[-2000:])

    @contextlib.contextmanager
    def session(self, req: RunRequest, *, log: LogFn) -> Iterator[Interactive]:
        """A warm sandbox: the same container as `run`, kept up and talked to in lines over
        its stdin/stdout (shards of one job, one after another). Removed on exit, also when
        the agent dies (guard)."""
        if shutil.which(self.runsc) is None and not Path(self.runsc).exists():
            raise SandboxError("runsc (gVisor) is not installed; jobs never run without it")
        with host_limits.job_cgroup(self.limits, req.name, memory_mb=req.memory_mb,
                                    cpus=req.cpus, pids=HOST_PIDS_CEILING,
                                    scope=self.scope) as cg:
            box = Interactive(host_limits.launcher(cg, self.argv(req, interactive=True)),
                              log=log, on_orphan=self.stop_argv(req.name),
                              cgroups=cg.paths if cg is not None else ())
            try:
                yield box
            finally:
                box.close(on_stop=lambda: self.halt(req.name))
                self.stop(req.name)

    def signal(self, name: str, sig: str = "TERM") -> None:
        """Deliver a signal to the job's processes (inside gVisor), e.g. to ask for a drain."""
        self.ops.kill(name, sig)

    def stop_argv(self, name: str) -> list[str]:
        return [self.podman, "rm", "--force", "--ignore", "--time", "0", name]

    def halt(self, name: str) -> None:
        """Stop a sandbox whose `podman run` is still attached: SIGKILL its container and let
        that podman clean up and exit by itself (run_streaming's grace). Removing it from
        under that podman instead, and then killing podman half-way through its own clean-up,
        is the race that leaves Podman 4's store "hosed": a layer left half-deleted and still
        mounted, so that every later podman command of the user fails ("unlinkat .../merged:
        device or resource busy") until the machine reboots (seen in CI, with every job of the
        platform queued after it)."""
        self.ops.kill(name, "KILL")

    def stop(self, name: str) -> None:
        self.ops.remove(name)

    def kill(self, name: str) -> None:
        """SIGKILL the gVisor sandbox in the job's cgroup (a no-op where there is none: then
        the caller's stop is what ends it)."""
        host_limits.kill_job(self.limits, name, self.scope)

    def processes(self, name: str) -> frozenset[int]:
        """conmon (a child subreaper) and everything below it: runsc, its gofer and the
        sandbox that opens the GPUs through nvproxy."""
        state = self.ops.state(name) or {}
        try:
            conmon = int(state.get("ConmonPid") or 0)
        except (TypeError, ValueError):
            return frozenset()
        return procs.descendants({conmon}, procs.process_table()) if conmon > 0 else frozenset()

    def sweep(self, label_value: str) -> list[str]:
        """Remove containers this agent left behind in an earlier life (found by label)."""
        found = self.ops.labelled(AGENT_LABEL, label_value)
        for name in found:
            self.stop(name)
        return found

    def sweep_images(self, prefix: str, keep: str = "") -> list[str]:
        """Remove images whose name starts with `prefix` (this agent's job images), but `keep`;
        returns those removed (not those left for a later sweep: see store_lock)."""
        return [ref for ref in self.ops.images()
                if ref.startswith(prefix) and ref != keep and self.remove_image(ref)]

    def exists(self, name: str) -> bool:
        return self.ops.state(name) is not None

    def remove_image(self, image: str) -> bool:
        return self.ops.remove_image(image)


CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def gpu_devices(gpus: tuple[tuple[str, int], ...], cdi_dirs: tuple[Path, ...] = CDI_DIRS,
                exists: Callable[[str], bool] = os.path.exists) -> list[str]:
    """Only the reserved GPUs: by CDI name where the host has NVIDIA's CDI spec (which also
    brings the driver's libraries), else their device nodes plus the control and uvm nodes."""
    if not gpus:
        return []
    uuids = ",".join(uuid for uuid, _ in gpus)
    env = ["--env", f"NVIDIA_VISIBLE_DEVICES={uuids}", "--env", f"CUDA_VISIBLE_DEVICES={uuids}"]
    has_cdi = any(p.name.startswith("nvidia") and p.suffix in (".yaml", ".json")
                  for d in cdi_dirs if d.is_dir() for p in d.iterdir())
    if has_cdi:
        return [arg for uuid, _ in gpus for arg in ("--device", f"nvidia.com/gpu={uuid}")] + env
    nodes = [f"/dev/nvidia{minor}" for _, minor in gpus]
    nodes += [n for n in CONTROL_NODES if exists(n)]
    return [arg for n in nodes for arg in ("--device", n)] + env


def runtime_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")


def _cgroup_v2() -> bool:
    return (host_limits.CGROUP_ROOT / "cgroup.controllers").exists()


def nvproxy_support(runsc: str = "runsc", run: Callable[..., Any] = subprocess.run) -> str:
    """'' when this runsc can pass NVIDIA GPUs into gVisor (nvproxy), else why not."""
    try:
        out = run([runsc, "flags"], capture_output=True, text=True, timeout=10, check=False)
    except OSError as e:
        return f"runsc not usable: {e}"
    text = (out.stdout or "") + (out.stderr or "")
    if "nvproxy" in text:
        return ""
    return "this runsc has no nvproxy: GPUs cannot be isolated under gVisor (a newer runsc can)"
