"""The owner's say over this machine, which is theirs before it is ours.

The agent asks twice a second. Outside the hours the owner allows, it takes no new work. While
the owner has paused it (`campugrid provider pause`), while a program the owner listed runs (a
game, a renderer), or while a process outside the platform uses a GPU the running job holds,
it takes no new work *and* drains the job it runs: SIGTERM inside the sandbox, a final
checkpoint, the task handed back without costing the job an attempt.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from campugrid.agent.gpus import nvml_text
from campugrid.protocol.errors import InvalidInput
from campugrid.sandbox.process import descendants, process_table

PAUSE_FILE = "paused"  # in the agent's state folder; its presence is the pause
UTIL_WINDOW_S = 5  # utilisation samples younger than this count
COMM_LEN = 15  # the kernel keeps this much of a process's name in /proc/PID/comm
_WINDOW = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)-([01]?\d|2[0-3]):([0-5]\d)$")


@dataclasses.dataclass(frozen=True)
class Hours:
    """When work is allowed, in the machine's local time: windows of minutes since midnight,
    a window whose end is before its start runs past midnight ("22:00-07:00")."""

    windows: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str) -> Hours:
        windows = []
        for part in (p.strip() for p in text.split(",")):
            m = _WINDOW.match(part)
            if m is None:
                raise InvalidInput(f"hours {part!r}: write HH:MM-HH:MM in 24-hour local time, "
                                   "several separated by commas (e.g. 22:00-07:00,12:00-13:30)")
            h1, m1, h2, m2 = (int(g) for g in m.groups())
            start, end = h1 * 60 + m1, h2 * 60 + m2
            if start == end:
                raise InvalidInput(f"hours {part!r}: a window must not start where it ends "
                                   "(leave --hours out to allow work at any time)")
            windows.append((start, end))
        return cls(tuple(windows))

    def allows(self, now: dt.datetime) -> bool:
        minute = now.hour * 60 + now.minute
        return any(start <= minute < end if start < end else minute >= start or minute < end
                   for start, end in self.windows)

    def __str__(self) -> str:
        return ",".join(f"{s // 60:02d}:{s % 60:02d}-{e // 60:02d}:{e % 60:02d}"
                        for s, e in self.windows)


@dataclasses.dataclass(frozen=True)
class OwnerPolicy:
    hours: Hours | None = None  # None: any time
    programs: tuple[str, ...] = ()  # while one of these runs, the machine is the owner's
    grace_seconds: float = 5.0  # from SIGTERM to kill when the owner takes the machine back


# --- pause --------------------------------------------------------------------------------------


def pause(state_dir: Path, by: str = "its owner") -> bool:
    """Pause the agent of `state_dir`; False if it was paused already (nothing changes)."""
    path = state_dir / PAUSE_FILE
    if path.exists():
        return False
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"since": dt.datetime.now(dt.UTC).isoformat(), "by": by}))
    tmp.replace(path)
    return True


def resume(state_dir: Path) -> bool:
    """False if it was not paused."""
    try:
        (state_dir / PAUSE_FILE).unlink()
    except FileNotFoundError:
        return False
    return True


def paused_since(state_dir: Path) -> str | None:
    try:
        info = json.loads((state_dir / PAUSE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "?"  # a pause file the owner wrote by hand pauses all the same
    return str(info.get("since", "?")) if isinstance(info, dict) else "?"


# --- listed programs ----------------------------------------------------------------------------


def _normal(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(".exe")  # Wine and Proton games keep their Windows names


def running_programs(names: Collection[str], proc: Path = Path("/proc"),
                     skip: Collection[int] = ()) -> list[str]:
    """Which of `names` run now, by any user: a process matches by its name (as the kernel
    keeps it, 15 characters) or by its program's file name (argv[0]), case-insensitive and
    with or without ".exe". Processes in `skip` and below them are not looked at (the agent
    and what it starts)."""
    wanted = {_normal(n) for n in names if n.strip()}
    if not wanted:
        return []
    # Names the kernel keeps whole; a longer one only where argv[0] is not there to tell
    # "renderer-pro-2024" from "renderer-pro-2025".
    short = {w[:COMM_LEN]: w for w in wanted}
    table = process_table(proc)
    mine = descendants(skip, table)
    found: set[str] = set()
    for pid, (_, comm, argv0) in table.items():
        if pid in mine:
            continue
        program = _normal(re.split(r"[/\\]", argv0)[-1]) if argv0 else ""
        name = _normal(comm)
        if program in wanted:
            found.add(program)
        elif name in wanted:
            found.add(name)
        elif not program and name in short:
            found.add(short[name])
    return sorted(found)


# --- GPUs the running job holds -----------------------------------------------------------------


def foreign_gpu_users(nvml: Any, uuids: Collection[str], ours: Callable[[int], bool]) -> list[str]:
    """Processes outside the platform on the GPUs in `uuids`, as NVML shows them (memory held,
    or utilisation sampled in the last seconds), each in words: "pid 4242 (blender) on GPU 0,
    1536 MiB". `ours(pid)` says whether a process belongs to the job's sandbox."""
    out: list[str] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml_text(nvml.nvmlDeviceGetUUID(h))
        if uuid not in uuids:
            continue
        users: dict[int, str] = {}
        for p in _processes(nvml, h):
            mem = getattr(p, "usedGpuMemory", None)
            users[int(p.pid)] = f", {int(mem) // 2**20} MiB" if isinstance(mem, int) else ""
        for s in _utilisation(nvml, h):
            if int(getattr(s, "smUtil", 0)) > 0:
                users.setdefault(int(s.pid), f", {int(s.smUtil)}% busy")
        out += [f"pid {pid} ({_process_name(pid)}) on GPU {index}{what}"
                for pid, what in sorted(users.items()) if not ours(pid)]
    return out


def _processes(nvml: Any, h: Any) -> Iterable[Any]:
    for call in (nvml.nvmlDeviceGetComputeRunningProcesses,
                 nvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            yield from call(h)
        except nvml.NVMLError:  # not supported on this GPU: the other list still counts
            continue


def _utilisation(nvml: Any, h: Any) -> Iterable[Any]:
    since_us = int((time.time() - UTIL_WINDOW_S) * 1e6)  # older samples: maybe gone since
    try:
        return list(nvml.nvmlDeviceGetProcessUtilization(h, since_us))
    except nvml.NVMLError:  # not supported, or no samples yet
        return []


def _process_name(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


# --- the owner ----------------------------------------------------------------------------------


class Owner:
    """Answers the two questions the agent asks, from the owner's policy and this machine."""

    def __init__(self, state_dir: Path, policy: OwnerPolicy, *, nvml: Any = None,
                 clock: Callable[[], dt.datetime] = dt.datetime.now,
                 proc: Path = Path("/proc")) -> None:
        self.state_dir, self.policy = state_dir, policy
        self.nvml, self.clock, self.proc = nvml, clock, proc
        self.skip = frozenset({os.getpid()})  # the agent itself, whatever it is called

    def drain_reason(self, gpu_uuids: Collection[str] = (),
                     ours: Callable[[int], bool] = lambda pid: False) -> str:
        """Why the job running now must go (empty: it may stay)."""
        if paused_since(self.state_dir) is not None:
            return "its owner paused the machine (campugrid provider pause)"
        programs = running_programs(self.policy.programs, self.proc, self.skip)
        if programs:
            return f"its owner's program {', '.join(programs)} started"
        if gpu_uuids and self.nvml is not None:
            users = self._foreign(gpu_uuids, ours)
            if users:
                return f"a process outside campugrid uses the job's GPU: {'; '.join(users)}"
        return ""

    def hold(self) -> str:
        """Why the machine takes no new work now (empty: it does)."""
        why = self.drain_reason()
        if not why and self.policy.hours is not None and not self.policy.hours.allows(self.clock()):
            why = f"outside the hours its owner allows ({self.policy.hours}, local time)"
        return why

    def _foreign(self, gpu_uuids: Collection[str], ours: Callable[[int], bool]) -> list[str]:
        try:
            self.nvml.nvmlInit()
        except Exception:  # the driver went away: nothing to watch on it
            return []
        try:
            return foreign_gpu_users(self.nvml, gpu_uuids, ours)
        finally:
            self.nvml.nvmlShutdown()
