"""The embedded apt cache that `campugrid up` starts: Debian's `apt-cacher-ng`, on 127.0.0.1,
caching under the state folder.

Machines reach it only through the coordinator (/v1/mirrors/apt, with their mirror token:
coordinator/mirrors.py). It is configured to fetch from the distributions' own mirrors alone
(`ForceManaged` with a Remap rule for each of APT_HOSTS): asked for any other host, it
refuses, so it is no open proxy to whoever else on this host can reach 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

from campugrid.cli.seaweed import end_group, end_processes, guard_group, start_time
from campugrid.coordinator.mirrors import APT_HOSTS
from campugrid.protocol.errors import StorageError
from campugrid.sandbox.process import release_guard

log = logging.getLogger(__name__)
# Each host's path prefixes: the repositories the cache serves (a Remap rule each)
REPOSITORIES = {"deb.debian.org": ("debian", "debian-security"),
                "security.debian.org": ("debian-security",),
                "archive.ubuntu.com": ("ubuntu",), "security.ubuntu.com": ("ubuntu",),
                "ports.ubuntu.com": ("ubuntu-ports",)}
assert set(REPOSITORIES) == set(APT_HOSTS)


def aptcache_binary() -> str | None:
    return shutil.which("apt-cacher-ng") or next(
        (p for p in ("/usr/sbin/apt-cacher-ng",) if os.access(p, os.X_OK)), None)


def _port() -> int:
    """A free port apt-cacher-ng can take: it reads Port as a signed 16-bit number, so
    none of the kernel's ephemeral ports (32768 and up) will do."""
    for candidate in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise StorageError("no free port below 32768 for the apt cache")


def _config(data_dir: Path, port: int) -> str:
    lines = [f"CacheDir: {data_dir / 'cache'}", f"LogDir: {data_dir / 'log'}",
             "SupportDir: /usr/lib/apt-cacher-ng", f"Port: {port}", "BindAddress: 127.0.0.1",
             f"SocketPath: {data_dir / 'socket'}", f"PidFile: {data_dir / 'acng.pid'}",
             "ForeGround: 1", "ExThreshold: 4", "ForceManaged: 1", "ReportPage:",
             "PassThroughPattern: ^$"]
    for n, (host, paths) in enumerate(sorted(REPOSITORIES.items())):
        for m, path in enumerate(paths):
            lines.append(f"Remap-r{n}x{m}: {host}/{path} ; http://{host}/{path}/")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class EmbeddedAptCache:
    data_dir: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    _guard_proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "aptcache.pid"

    def start(self, timeout_s: float = 30) -> EmbeddedAptCache:
        binary = aptcache_binary()
        if binary is None:
            raise StorageError("apt-cacher-ng is not installed (Debian: apt-get install "
                               "apt-cacher-ng; infra/setup.sh does it)")
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir = self.data_dir.resolve()
        for sub in ("cache", "log", "conf"):
            (self.data_dir / sub).mkdir(exist_ok=True)
        self._stop_stale()
        self.port = self.port or _port()
        (self.data_dir / "conf" / "acng.conf").write_text(_config(self.data_dir, self.port))
        with open(self.data_dir / "aptcache.log", "ab") as out:
            self.process = subprocess.Popen([binary, "-c", str(self.data_dir / "conf")],
                                            stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.data_dir,
                                            start_new_session=True)
        self._guard_proc = guard_group(self.process.pid)
        self.pidfile.write_text(json.dumps({"pid": self.process.pid,
                                            "start_time": start_time(self.process.pid)}))
        self._wait_ready(timeout_s)
        return self

    def _stop_stale(self) -> None:
        """An apt cache left by an owner killed with its guard, on this folder."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded = json.loads(self.pidfile.read_text())
            pid = int(recorded["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if start_time(pid) == recorded["start_time"] and \
                    os.fsencode(self.data_dir / "conf") in cmdline:
                log.warning("stopping the apt cache left running on %s (pid %d)",
                            self.data_dir, pid)
                end_processes([pid], "the apt cache")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise StorageError(f"apt-cacher-ng exited ({code}); see "
                                   f"{self.data_dir / 'aptcache.log'}")
            try:
                # any answer: up (it refuses a bare / with 403, as it should)
                httpx.get(f"http://{self.address}/", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise StorageError(f"apt-cacher-ng did not answer on {self.address} in "
                           f"{timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None:
            end_group(self.process, timeout_s=10)
        if self._guard_proc is not None:
            release_guard(self._guard_proc)
            self._guard_proc = None
        self.pidfile.unlink(missing_ok=True)
