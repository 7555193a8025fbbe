"""A child process whose output is streamed line by line, with a deadline and a cancel switch.

Shared by the builders and the sandbox: both run podman/buildah as the provider user and
must kill the whole process group (not just the direct child) when time is up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

LogFn = Callable[[str], None]
MAX_LINE = 64 * 1024


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
    tail_lines: int = 40,
) -> Finished:
    """Run argv, send each output line to `log`, stop it at the deadline or on cancel.

    `on_stop` runs first when stopping (e.g. `podman rm -f NAME`, which also tears down the
    sandbox that podman's own process group does not contain); then the group gets SIGKILL.
    `on_orphan` is a command that a guard process runs if *this* process dies first (even by
    SIGKILL): the child's group is killed, then the command cleans up what lives outside it.
    """
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    guard = _guard(proc.pid, on_orphan) if on_orphan else None
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
            if on_stop is not None:
                on_stop()
            _kill_group(proc)
            break
        time.sleep(0.05)
    proc.wait()
    reader.join(timeout=5)
    if guard is not None:
        _release(guard)
    return Finished(proc.returncode, timed_out, cancelled, "\n".join(tail))


_GUARD = """
read line
[ "$line" = done ] && exit 0
kill -KILL -- "-$0" 2>/dev/null
exec "$@"
"""


def _guard(pgid: int, cleanup: Sequence[str]) -> subprocess.Popen[bytes]:
    """A process in its own session that waits on a pipe only we hold. EOF (we died) means:
    kill the child's group and run `cleanup`; a "done" line means we finished normally."""
    return subprocess.Popen(["/bin/sh", "-c", _GUARD, str(pgid), *cleanup],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _release(guard: subprocess.Popen[bytes]) -> None:
    assert guard.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        guard.stdin.write(b"done\n")
        guard.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        guard.wait(timeout=5)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
