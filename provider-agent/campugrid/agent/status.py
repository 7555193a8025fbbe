"""What the agent tells its owner: a small file in its state folder, rewritten whenever
something changes, that `campugrid provider status` reads (the agent opens no port for it)."""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
LAST_JOBS = 10


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class StatusFile:
    """The agent's side: one writer, rewritten whole (atomically) on every change."""

    def __init__(self, state_dir: Path, **fixed: Any) -> None:
        self.path = state_dir / STATUS_FILE
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"pid": os.getpid(), "pid_start": _start_ticks(os.getpid()),
                                       "started_at": now(), **fixed,
                                       "held": "", "task": None, "last_jobs": []}
        self._write()

    def update(self, **changes: Any) -> None:
        with self._lock:
            self._state.update(changes)
            self._write()

    def task_started(self, job_id: str, attempt: int) -> None:
        self.update(task={"job_id": job_id, "attempt": attempt, "since": now()})

    def task_ended(self, how: str) -> None:
        with self._lock:
            task = self._state.get("task") or {}
            ended = {**task, "ended_at": now(), "how": how}
            self._state["last_jobs"] = [ended, *self._state["last_jobs"]][:LAST_JOBS]
            self._state["task"] = None
            self._write()

    def _write(self) -> None:
        self._state["updated_at"] = now()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=1))
        tmp.replace(self.path)


def read(state_dir: Path) -> dict[str, Any] | None:
    """The owner's side: what the agent last wrote, with `running` (whether its process is
    still alive); None if no agent ever ran from this folder."""
    try:
        state = json.loads((state_dir / STATUS_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    pid, started = state.get("pid"), state.get("pid_start")
    # the same pid and the same start time: the agent, not a later process given its pid
    state["running"] = (isinstance(pid, int) and pid > 0 and started is not None
                        and _start_ticks(pid) == started)
    return state


def _start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat, field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None
