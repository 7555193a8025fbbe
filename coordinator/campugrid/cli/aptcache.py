"""The embedded apt cache that `campugrid up` starts: Debian's `apt-cacher-ng`, on 127.0.0.1,
caching under the state folder.

Machines reach it only through the coordinator (/v1/mirrors/apt, with their mirror token:
coordinator/mirrors.py). It is configured to fetch from the distributions' own mirrors alone
(`ForceManaged` with a Remap rule for each of APT_HOSTS): asked for any other host, it
refuses, so it is no open proxy to whoever else on this host can reach 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import socket
from pathlib import Path
from typing import ClassVar

import httpx

from campugrid.cli.daemon import Daemon
from campugrid.egress.policy import APT_HOSTS
from campugrid.protocol.errors import StorageError

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


def _answers(address: str) -> bool:
    try:
        httpx.get(f"http://{address}/", timeout=2)  # any answer (it refuses a bare / with 403)
        return True
    except httpx.HTTPError:
        return False


@dataclasses.dataclass
class EmbeddedAptCache(Daemon):
    port: int = 0
    what: ClassVar[str] = "the apt cache"
    name: ClassVar[str] = "aptcache"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30) -> EmbeddedAptCache:
        binary = aptcache_binary()
        if binary is None:
            raise StorageError("apt-cacher-ng is not installed (Debian: apt-get install "
                               "apt-cacher-ng; infra/setup.sh does it)")
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir = self.data_dir.resolve()
        for sub in ("cache", "log", "conf"):
            (self.data_dir / sub).mkdir(exist_ok=True)
        self._stop_stale(self.data_dir / "conf")
        self.port = self.port or _port()
        (self.data_dir / "conf" / "acng.conf").write_text(_config(self.data_dir, self.port))
        self._launch([binary, "-c", str(self.data_dir / "conf")])
        self._wait_ready(lambda: _answers(self.address), self.address, timeout_s)
        return self
