"""run_streaming's stop (sandbox/process.py), on real child processes: the child is told to
stop (`on_stop`) and given a grace to finish by itself, as a podman whose container was
killed needs to clean up; only what outlives the grace, or a stop that failed, is killed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from campugrid.sandbox.process import run_streaming

pytestmark = pytest.mark.integration

# On SIGUSR1 it takes a moment to "clean up", says so, and exits as podman does after its
# container was killed (137); `ignore` makes it ignore the signal instead.
CHILD = r"""
import os, signal, sys, time
def finish(*_):
    time.sleep(0.5)
    print("cleaned-up", flush=True)
    sys.exit(137)
signal.signal(signal.SIGUSR1, signal.SIG_IGN if sys.argv[1] == "ignore" else finish)
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""


def run(mode: str, on_stop_raises: bool = False) -> tuple[object, list[str], float]:
    lines: list[str] = []
    cancel = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        cancel.set()  # once it is up: stop it

    def on_stop() -> None:
        if on_stop_raises:
            raise RuntimeError("the container could not be asked to stop")
        os.kill(int(lines[0].split()[1]), signal.SIGUSR1)

    began = time.monotonic()
    done = run_streaming([sys.executable, "-c", CHILD, mode], log=log, timeout_s=60,
                         cancel=cancel, on_stop=on_stop, stop_grace_s=3)
    return done, [line.split()[0] for line in lines], time.monotonic() - began


def test_a_stopped_child_finishes_its_clean_up_and_exits_by_itself():
    done, lines, _ = run("finish")
    assert done.cancelled and (done.returncode, lines) == (137, ["ready", "cleaned-up"])


def test_a_child_that_does_not_stop_is_killed_after_the_grace():
    done, lines, took = run("ignore")
    assert done.cancelled and done.returncode == -9 and lines == ["ready"]
    assert 3 <= took < 15, took


def test_a_stop_that_fails_kills_the_child_at_once():
    done, lines, took = run("raising", on_stop_raises=True)
    assert done.cancelled and done.returncode == -9 and lines == ["ready"]
    assert took < 3, took
