"""A program that `campugrid up` keeps running beside the coordinator (the registries, the apt
cache): in a process group of its own, killed by a guard if we die (even by SIGKILL), with a
pid file that lets the next start stop one that such a death left running."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from campugrid.cli.seaweed import end_group, end_processes, guard_group, start_time
from campugrid.guards import release_guard
from campugrid.protocol.errors import StorageError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Daemon:
    data_dir: Path
    _: dataclasses.KW_ONLY
    process: subprocess.Popen[bytes] | None = None
    _guard_proc: subprocess.Popen[bytes] | None = None
    what: ClassVar[str] = "the daemon"  # as messages name it
    name: ClassVar[str] = "daemon"  # its pid and log files: <name>.pid, <name>.log

    @property
    def pidfile(self) -> Path:
        return self.data_dir / f"{self.name}.pid"

    @property
    def logfile(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    def _launch(self, argv: list[str]) -> None:
        with open(self.logfile, "ab") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.data_dir,
                                            start_new_session=True)
        self._guard_proc = guard_group(self.process.pid)
        self.pidfile.write_text(json.dumps({"pid": self.process.pid,
                                            "start_time": start_time(self.process.pid)}))

    def _stop_stale(self, marker: Path) -> None:
        """One left on this folder by an owner killed with its guard: the process its pid
        file names, if it is still that process and its command line names `marker`."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded = json.loads(self.pidfile.read_text())
            pid = int(recorded["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if start_time(pid) == recorded["start_time"] and os.fsencode(marker) in cmdline:
                log.warning("stopping %s left running on %s (pid %d)", self.what,
                            self.data_dir, pid)
                end_processes([pid], self.what)

    def _wait_ready(self, ready: Callable[[], bool], address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise StorageError(f"{self.what} exited ({code}); see {self.logfile}")
            if ready():
                return
            time.sleep(0.1)
        self.stop()
        raise StorageError(f"{self.what} did not answer on {address} in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None:
            end_group(self.process, timeout_s=10)
        if self._guard_proc is not None:
            release_guard(self._guard_proc)
            self._guard_proc = None
        self.pidfile.unlink(missing_ok=True)
