"""`campugrid up` leaves nothing running behind it, however it dies, comes back up on the
same state folder at the first try, and starts its agent again when the agent dies."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from campugrid.cli.platform import have
from campugrid.cli.seaweed import end_processes, free_port

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(os.geteuid() != 0, reason="`up` as root, with the provider user"),
    pytest.mark.skipif(bool(have("podman", "buildah", "runsc")), reason="no container stack"),
]
REPO = Path(__file__).resolve().parents[2]
CAMPUGRID = Path(sys.executable).with_name("campugrid")


class Up:
    """`campugrid up` as a subprocess, its output collected line by line."""

    def __init__(self, state_dir: Path, port: int) -> None:
        # The admin identity `up` makes goes beside its state, not into root's own config.
        env = {**os.environ, "CAMPUGRID_IDENTITY": str(state_dir.parent / "identity.json")}
        self.proc = subprocess.Popen(
            [str(CAMPUGRID), "up", "--state-dir", str(state_dir), "--http-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, cwd=REPO, env=env)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        out = self.proc.stdout
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(out.readline, "")),
                                        daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith("campugrid is up") for line in self.lines):
            if self.proc.poll() is not None:
                pytest.fail(f"`campugrid up` exited ({self.proc.returncode}):\n{self.output[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"`campugrid up` not up in {timeout:.0f} s:\n{self.output[-3000:]}")
            time.sleep(0.1)

    def end(self, sig: int, timeout: float = 90) -> int:
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            pytest.fail(f"`campugrid up` still running {timeout:.0f} s after signal {sig}")
        finally:
            self._reader.join(timeout=5)
            assert self.proc.stdout is not None
            self.proc.stdout.close()
        return code

    @classmethod
    def start(cls, state_dir: Path, port: int) -> Up:
        up = cls(state_dir, port)
        try:
            up.wait_up()
        except BaseException:
            up.end(signal.SIGKILL)
            raise
        return up


def mentioning(path: Path) -> dict[int, str]:
    """Live processes whose command line names `path` (zombies have none)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline:
            found[int(entry.name)] = cmdline[:200]
    return found


def left_after(path: Path, seconds: float) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    while (left := mentioning(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def agent_python(state_dir: Path) -> int | None:
    """The agent's own Python process (not the runuser in front of it)."""
    for pid, cmdline in mentioning(state_dir / "agents").items():
        if "campugrid.cli agent run" in cmdline and not cmdline.startswith("runuser"):
            return pid
    return None


def registrations(state_dir: Path) -> int:
    log = state_dir / "agents" / "local-agent.log"
    return log.read_text().count(" registered as ") if log.exists() else 0


def wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.fixture
def where() -> Iterator[tuple[Path, int]]:
    root = Path(tempfile.mkdtemp(prefix="campugrid-up-"))
    os.chmod(root, 0o711)  # the provider user must traverse it
    try:
        yield root, free_port()
    finally:  # a failed test must not leave the platform running either
        with contextlib.suppress(Exception):
            end_processes(list(mentioning(root)), "left by the test")
        shutil.rmtree(root, ignore_errors=True)


def test_kill_9_of_up_leaves_nothing_and_the_next_up_comes_up_first_try(where):
    root, port = where
    state = root / "state"
    first = Up.start(state, port)
    running = mentioning(root)
    assert any("weed server" in c for c in running.values()), running
    assert any("agent run" in c for c in running.values()), running

    first.end(signal.SIGKILL)
    assert left_after(root, 10) == {}, "outlived `campugrid up`"

    second = Up.start(state, port)  # the first try: no "SeaweedFS exited (255)"
    assert httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).status_code == 200
    assert second.end(signal.SIGTERM) == 0, second.output[-3000:]
    assert left_after(root, 10) == {}, "outlived a stopped `campugrid up`"


def test_up_starts_its_agent_again_when_it_dies(where):
    root, port = where
    state = root / "state"
    up = Up.start(state, port)
    try:
        wait_for("the agent to register", lambda: registrations(state) >= 1)
        killed = agent_python(state)
        assert killed is not None, mentioning(root)
        os.kill(killed, signal.SIGKILL)
        new = wait_for("a new agent process",
                       lambda: (pid := agent_python(state)) not in (None, killed) and pid, timeout=30)
        wait_for("the new agent to register", lambda: registrations(state) >= 2, timeout=60)
        assert "agent local-agent exited" in up.output and "started again" in up.output, up.output
        assert agent_python(state) == new
    finally:
        code = up.end(signal.SIGINT)
    assert code == 0, up.output[-3000:]
    assert left_after(root, 10) == {}, "outlived a stopped `campugrid up`"


def test_the_rest_port_is_held_before_anything_else_starts(tmp_path: Path):
    """A port taken by someone else is said at once, before S3 or a registry start; the port
    a platform was given is its own from the first moment (no other service it starts can be
    handed it)."""
    import socket

    from campugrid.cli.platform import Platform
    from campugrid.protocol.errors import CampugridError

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = Platform(tmp_path / "state", http_port=port)
        with pytest.raises(CampugridError, match=f"cannot listen on 127.0.0.1:{port}"):
            p.start()
        assert p.s3 is None and not (tmp_path / "state").exists()
