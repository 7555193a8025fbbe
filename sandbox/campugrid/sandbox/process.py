"""A child process whose output is streamed line by line, with a deadline and a cancel switch.

Shared by the builders and the sandbox: both run podman/buildah as the provider user and
must kill the whole process group (not just the direct child) when time is up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from campugrid.guards import guard, release_guard

logger = logging.getLogger(__name__)
LogFn = Callable[[str], None]
MAX_LINE = 64 * 1024
# After `on_stop`, how long the child has to finish by itself before its group is killed: a
# podman whose container was killed still unmounts and records what it did, and killing it
# half-way can leave the provider's whole store unusable (see PodmanRunsc.halt).
STOP_GRACE_S = 20.0


@dataclasses.dataclass(frozen=True)
class Finished:
    returncode: int
    timed_out: bool
    cancelled: bool
    tail: str  # the last lines of output, for error messages


def run_streaming(
    argv: Sequence[str],
    *,
    log: LogFn,
    timeout_s: float,
    cancel: threading.Event | None = None,
    on_stop: Callable[[], None] | None = None,
    on_orphan: Sequence[str] | None = None,
    cgroups: Sequence[Path] = (),
    tail_lines: int = 40,
    stop_grace_s: float = STOP_GRACE_S,
) -> Finished:
    """Run argv, send each output line to `log`, stop it at the deadline or on cancel.

    `on_stop` runs first when stopping (e.g. killing the container, which podman's own
    process group does not contain); the child then has `stop_grace_s` to exit by itself
    (podman cleaning up after its container), and then the group gets SIGKILL.
    `on_orphan` is a command (possibly empty) that a guard process runs if *this* process dies
    first (even by SIGKILL): the command cleans up what lives outside the child's group, then
    the group and every process in `cgroups` are killed.
    """
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    watcher = (guard(proc.pid, on_orphan or (), cgroups)
               if on_orphan is not None or cgroups else None)
    assert proc.stdout is not None
    stream = proc.stdout

    def pump() -> None:
        # Bounded reads: output without newlines must not grow the agent's memory.
        for raw in iter(lambda: stream.readline(MAX_LINE), b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tail.append(line)
            log(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    timed_out = cancelled = False
    while proc.poll() is None:
        if cancel is not None and cancel.is_set():
            cancelled = True
        elif time.monotonic() >= deadline:
            timed_out = True
        if timed_out or cancelled:
            _stop(proc, on_stop, stop_grace_s)
            break
        time.sleep(0.05)
    proc.wait()
    reader.join(timeout=5)
    if not reader.is_alive():  # (else a grandchild still holds the pipe open: the file
        stream.close()         # is left to the reader, to go when the pipe does)
    if watcher is not None:
        release_guard(watcher)
    return Finished(proc.returncode, timed_out, cancelled, "\n".join(tail))


class Interactive:
    """A long-lived child we talk to in lines: send() to its stdin, receive() from its
    stdout; stderr lines go to `log`. Guarded like run_streaming: if this process dies, the
    child's group is killed and `on_orphan` runs."""

    def __init__(self, argv: Sequence[str], *, log: LogFn,
                 on_orphan: Sequence[str] | None = None, cgroups: Sequence[Path] = ()) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.guard = (guard(self.proc.pid, on_orphan or (), cgroups)
                      if on_orphan is not None or cgroups else None)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out, err = self.proc.stdout, self.proc.stderr

        def pump_out() -> None:
            for raw in iter(lambda: out.readline(MAX_LINE * 2), b""):
                self._lines.put(raw)
            self._lines.put(None)

        def pump_err() -> None:
            for raw in iter(lambda: err.readline(MAX_LINE), b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.tail.append(line)
                log(line)

        self._readers = [threading.Thread(target=pump_out, daemon=True),
                         threading.Thread(target=pump_err, daemon=True)]
        for t in self._readers:
            t.start()

    def send(self, line: bytes) -> bool:
        """False if the child no longer reads."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):
            return False

    def receive(self, timeout_s: float) -> bytes | None:
        """The next stdout line; b"" if none came in time; None once the child has exited."""
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            return b""

    def close(self, on_stop: Callable[[], None] | None = None, grace_s: float = 5.0) -> int:
        """End of input; wait `grace_s` for the child to finish, then stop it."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _stop(self.proc, on_stop, STOP_GRACE_S)
        for t in self._readers:
            t.join(timeout=5)
        if self.guard is not None:
            release_guard(self.guard)
        return self.proc.returncode


def _stop(proc: subprocess.Popen[bytes], on_stop: Callable[[], None] | None,
          grace_s: float) -> None:
    """`on_stop`, a grace for the child to finish after it, then SIGKILL to whatever is left
    of its group (at once when `on_stop` failed)."""
    if on_stop is not None:
        try:
            on_stop()
        except Exception:
            logger.warning("stopping process %d: its on_stop failed; killing it", proc.pid,
                           exc_info=True)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


# --- host processes -----------------------------------------------------------------------------


def process_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, name, argv[0]) of every process this user may see."""
    out: dict[int, tuple[int, str, str]] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # gone since the listing
            continue
        # "pid (comm) state ppid ...": the name may hold spaces and parentheses
        head, _, rest = stat.rpartition(")")
        comm = head.split("(", 1)[1] if "(" in head else ""
        try:
            ppid = int(rest.split()[1])
        except (IndexError, ValueError):
            continue
        out[int(entry.name)] = (ppid, comm, argv0)
    return out


def descendants(roots: Collection[int], table: dict[int, tuple[int, str, str]]) -> frozenset[int]:
    """`roots` and every process below them, from a process_table."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    todo = [r for r in roots if r > 0]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return frozenset(seen)
