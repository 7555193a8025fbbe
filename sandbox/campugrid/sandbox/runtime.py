"""The sandbox runtime interface: the few verbs the agent drives a job's sandbox with.

Implementations: podman_runsc.PodmanRunsc (rootless Podman + gVisor, the real one) and
fake.FakeRuntime (failures from the job's env, for tests). Both pass
tests/integration/test_runtime_contract.py.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from campugrid.sandbox.limits import HostLimits
from campugrid.sandbox.podman_ops import PodmanOps
from campugrid.sandbox.process import LogFn

OUTPUT_MOUNT = "/output"
DATA_MOUNT = "/data"


@dataclasses.dataclass(frozen=True)
class RunRequest:
    name: str  # container name, unique per attempt
    image: str
    command: tuple[str, ...] | None
    env: tuple[tuple[str, str], ...]
    output_dir: Path | None  # the one writable host folder (None: the job writes only /tmp)
    data_dir: Path | None  # mounted read-only at /data
    memory_mb: int
    cpus: float
    tmp_mb: int
    wall_time_s: int
    agent: str = ""  # the agent's machine id, as a label: what to sweep after a crash
    mounts: tuple[tuple[Path, str, str], ...] = ()  # (host path, container path, "ro"|"rw")
    gpus: tuple[tuple[str, int], ...] = ()  # reserved GPUs: (uuid, /dev/nvidia<minor>)
    file_mb: int | None = None  # no file the job writes may be larger (RLIMIT_FSIZE, in gVisor)


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    timed_out: bool
    cancelled: bool
    oom_killed: bool
    tail: str
    limits: dict[str, str]
    started_s: float | None = None  # from launch to the sandbox running, where the runtime knows


class Session(Protocol):
    """A warm sandbox talked to in lines: the job's stdin and stdout (stderr goes to the log)."""

    @property
    def tail(self) -> Sequence[str]:
        """The last stderr lines, for error messages."""
        ...

    def send(self, line: bytes) -> bool:
        """False if the sandbox no longer reads."""
        ...

    def receive(self, timeout_s: float) -> bytes | None:
        """The next stdout line; b"" if none came in time; None once the sandbox has exited."""
        ...


class Runtime(Protocol):
    """One verb per step of a task's life. Names are unique per attempt (RunRequest.name)."""

    scope: str  # this agent's folder of job cgroups and images: what its sweeps may remove

    @property
    def name(self) -> str: ...

    @property
    def limits(self) -> HostLimits:
        """How this host enforces each resource limit (never claimed when it does not)."""
        ...

    @property
    def seccomp(self) -> Path | None:
        """The seccomp profile jobs get inside the sandbox, if any."""
        ...

    @property
    def ops(self) -> PodmanOps:
        """What the agent asks its container engine besides starting sandboxes: images (size,
        layers, ENV, tags) and containers by name. The fake keeps them in memory."""
        ...

    def describe(self) -> str:
        """The runtime and its version, as reported to the coordinator (e.g. "runsc 20221219").
        Raises SandboxError if the runtime is missing."""
        ...

    def gpu_isolation_note(self) -> str:
        """'' when GPUs can be passed into the sandbox isolated, else why not."""
        ...

    def run(self, req: RunRequest, *, log: LogFn,
            cancel: threading.Event | None = None) -> RunResult:
        """Run the job to its end, its output lines to `log`; stopped at the wall time or on
        `cancel`. Nothing of it remains afterwards. Raises SandboxError when the sandbox
        itself could not be made or started (not the job's fault)."""
        ...

    def session(self, req: RunRequest, *, log: LogFn) -> AbstractContextManager[Session]:
        """The same sandbox as `run`, kept up and talked to in lines until the block ends."""
        ...

    def signal(self, name: str, sig: str = "TERM") -> None:
        """Deliver a signal to the job's processes (e.g. to ask for a drain)."""
        ...

    def stop(self, name: str) -> None:
        """Remove the sandbox now (its `run` returns); no error if it is gone already."""
        ...

    def kill(self, name: str) -> None:
        """Kill the sandbox at once, without grace (a limit was passed), where the host can;
        its `run` then returns as after an out-of-memory kill. The caller stops it after."""
        ...

    def exists(self, name: str) -> bool: ...

    def processes(self, name: str) -> frozenset[int]:
        """The host processes that make up the job's sandbox (what NVML may show using its
        GPUs); empty once it is gone."""
        ...

    def sweep(self, label_value: str) -> list[str]:
        """Remove sandboxes this agent (RunRequest.agent) left in an earlier life."""
        ...

    def sweep_images(self, prefix: str, keep: str = "") -> list[str]:
        """Remove the images whose name starts with `prefix`, but `keep`; returns those
        removed."""
        ...

    def remove_image(self, image: str) -> bool:
        """False: left for a later sweep (another agent of this user is writing to the
        store)."""
        ...
