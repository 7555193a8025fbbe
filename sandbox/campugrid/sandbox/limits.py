"""Which resource limits really hold on this host, and the per-job cgroup that makes them hold.

Rootless Podman on cgroup v1 silently ignores --memory, --cpus and --pids-limit. What does hold
there is a cgroup v1 subtree that root delegated once to the provider user (infra/setup.sh does
it): the sandbox makes a child cgroup per job, writes the limits, and starts podman inside it;
with runsc's ignore-cgroups, conmon, the gofer and the sandbox all stay in it. Where neither is
available the limit is reported as not enforced, never assumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from campugrid.protocol.spec import ENFORCED

CGROUP_ROOT = Path("/sys/fs/cgroup")
DELEGATED = "campugrid"  # the subtree infra/setup.sh hands to the provider user


def delegated_subtree(user: str | None = None) -> str:
    """The cgroup v1 folder root hands to one provider user: `campugrid` for the user of
    that name (infra/setup.sh), `campugrid-USER` for any other (`provider prepare`), so that
    several users may lend the same machine."""
    if user is None:
        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:  # a uid without a passwd entry (containers)
            user = str(os.geteuid())
    return DELEGATED if user == DELEGATED else f"{DELEGATED}-{user}"
CONTROLLERS = ("memory", "cpu", "pids")


@dataclasses.dataclass(frozen=True)
class HostLimits:
    """How this host enforces each limit: 'enforced' or 'not enforced: <why>'."""

    memory: str
    cpu: str
    pids: str
    disk: str = ENFORCED  # /tmp is a size-bounded tmpfs and the root is read-only
    wall_time: str = ENFORCED
    v1_delegated: Path | None = None  # e.g. /sys/fs/cgroup (with memory/campugrid etc. ours)
    subtree: str = DELEGATED  # under v1_delegated/<controller>/

    def as_dict(self) -> dict[str, str]:
        return {"memory": self.memory, "cpu": self.cpu, "pids": self.pids,
                "disk": self.disk, "wall_time": self.wall_time}


def detect(root: Path = CGROUP_ROOT, subtree: str | None = None) -> HostLimits:
    if (root / "cgroup.controllers").exists():
        why = ("not enforced: cgroup v2 host; podman is asked for the limit but "
               "campugrid has not verified delegation here")
        return HostLimits(memory=why, cpu=why, pids=why)
    subtree = subtree or delegated_subtree()
    if all(_writable(root / c / subtree) for c in CONTROLLERS):
        return HostLimits(memory=ENFORCED, cpu=ENFORCED, pids=ENFORCED, v1_delegated=root,
                          subtree=subtree)
    why = ("not enforced: rootless Podman on cgroup v1 ignores it and no cgroup subtree is "
           f"delegated to this user (as root: `campugrid provider prepare --user USER` "
           f"delegates {subtree}/)")
    return HostLimits(memory=why, cpu=why, pids=why)


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


@dataclasses.dataclass(frozen=True)
class JobCgroup:
    paths: tuple[Path, ...]

    def procs_files(self) -> list[Path]:
        return [p / "cgroup.procs" for p in self.paths]

    def oom_killed(self) -> bool:
        """The kernel's OOM killer acted in this cgroup (memory.failcnt would also count
        ordinary page-cache reclaim at the limit)."""
        for p in self.paths:
            if (p / "memory.oom_control").exists():
                try:
                    for line in (p / "memory.oom_control").read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value) > 0
                except (OSError, ValueError):
                    return False
        return False


@contextlib.contextmanager
def job_cgroup(limits: HostLimits, name: str, *, memory_mb: int, cpus: float,
               pids: int, scope: str = "", wait_s: float = 1.0) -> Iterator[JobCgroup | None]:
    """A child cgroup per controller with the job's limits, under this agent's `scope`
    folder (so its sweeps never touch another agent's); emptied and removed afterwards
    (`release`, waiting up to `wait_s` here)."""
    if limits.v1_delegated is None:
        yield None
        return
    made: list[Path] = []
    try:
        for ctrl in CONTROLLERS:
            parent = limits.v1_delegated / ctrl / limits.subtree
            if scope:
                parent = parent / scope
                parent.mkdir(exist_ok=True)
            path = parent / name
            path.mkdir(exist_ok=True)
            made.append(path)
            if ctrl == "memory":
                (path / "memory.limit_in_bytes").write_text(str(memory_mb * 1024 * 1024))
            elif ctrl == "cpu":
                period = 100_000
                (path / "cpu.cfs_period_us").write_text(str(period))
                (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * period))))
            elif ctrl == "pids":
                (path / "pids.max").write_text(str(pids))
        yield JobCgroup(tuple(made))
    finally:
        release(made, wait_s)


REAP_GRACE_S = 30.0  # e.g. the build runtime's background `runsc delete` (~5 s) finishing


def release(paths: Sequence[Path], wait_s: float = 1.0) -> None:
    """Remove a job's cgroups once they are empty: wait up to `wait_s` here, then give what
    still runs in them REAP_GRACE_S to finish (in the background), then kill it."""
    deadline = time.monotonic() + wait_s
    while not _remove_if_empty(paths):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    else:
        return
    threading.Thread(target=_reap, args=(tuple(paths),), daemon=True, name="cgroup-reaper").start()


def _reap(paths: tuple[Path, ...]) -> None:
    deadline = time.monotonic() + REAP_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if _remove_if_empty(paths):
            return
    kill_all(paths)


def kill_all(paths: Sequence[Path], attempts: int = 50) -> None:
    """SIGKILL every process in these cgroups until none is left, then remove them. Unlike a
    process group, a cgroup also holds what its members started with setsid."""
    for _ in range(attempts):
        if _remove_if_empty(paths):
            return
        for pid in _members(paths):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def kill_job(limits: HostLimits, name: str, scope: str) -> None:
    """SIGKILL one job's gVisor sandbox now (a limit was passed: no grace). Only the sandbox:
    conmon and podman stay to see it exit and clean up, as after an OOM kill."""
    if limits.v1_delegated is None:
        return
    paths = [limits.v1_delegated / ctrl / limits.subtree / scope / name if scope else
             limits.v1_delegated / ctrl / limits.subtree / name for ctrl in CONTROLLERS]
    for pid in _members(paths):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"runsc-sandbox"):
                os.kill(pid, signal.SIGKILL)


def sweep(limits: HostLimits, scope: str) -> list[str]:
    """Kill and remove every cgroup left in this agent's scope (an earlier life of it, or a
    task that has ended). Returns the names removed."""
    if limits.v1_delegated is None or not scope:
        return []
    folders = [limits.v1_delegated / ctrl / limits.subtree / scope for ctrl in CONTROLLERS]
    names = sorted({child.name for folder in folders for child in _children(folder)})
    for name in names:
        kill_all([folder / name for folder in folders])
    _remove_if_empty(folders)  # made again by the next job
    return names


def _children(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _members(paths: Sequence[Path]) -> list[int]:
    pids: set[int] = set()
    for p in paths:
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(x) for x in (p / "cgroup.procs").read_text().split())
    return sorted(pids)


def _remove_if_empty(paths: Sequence[Path]) -> bool:
    done = True
    for p in paths:
        try:
            p.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            done = False  # still has members (EBUSY)
    return done


def launcher(cg: JobCgroup | None, argv: list[str]) -> list[str]:
    """argv wrapped so that it starts inside the job's cgroups (children inherit them)."""
    if cg is None:
        return argv
    sh = shutil.which("sh") or "/bin/sh"
    moves = "; ".join(f'echo $$ > "{f}"' for f in cg.procs_files())
    return [sh, "-c", f'{moves} && exec "$@"', "campugrid-launch", *argv]
