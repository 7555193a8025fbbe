"""The embedded OCI registry that `campugrid up` and the tests start: Debian's
`docker-registry` (the CNCF distribution registry), on 127.0.0.1, storing on disk; and the
same program as a pull-through mirror of Docker Hub (coordinator/bases.py).

It accepts only bearer tokens the coordinator signs (coordinator/registry.py): a machine can
push the one repository its task builds and pull the one it was told to, and nothing lists
the catalogue. Deleting manifests is on, for the coordinator's garbage collection. At scale
any registry configured the same way replaces it (README: "Shared images").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from campugrid.cli.seaweed import end_group, end_processes, free_port, guard_group, start_time
from campugrid.coordinator.registry import ISSUER, SERVICE
from campugrid.protocol.errors import StorageError
from campugrid.sandbox.process import release_guard

log = logging.getLogger(__name__)


def registry_binary() -> str:
    found = shutil.which("docker-registry") or shutil.which("registry")
    if not found:
        raise StorageError("the OCI registry is not installed (Debian: apt-get install "
                           "docker-registry; infra/setup.sh does it)")
    return found


def _config(data_dir: Path, port: int, cert: Path, proxy: str) -> dict[str, object]:
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(data_dir / "data")},
                    "delete": {"enabled": True}, "cache": {"blobdescriptor": "inmemory"}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(32)},
        "auth": {"token": {
            # Tokens come over the agents' gRPC calls; nothing is handed out here.
            "realm": "https://campugrid.invalid/no-token-endpoint",
            "service": SERVICE, "issuer": ISSUER, "rootcertbundle": str(cert)}},
    }
    if proxy:  # a read-only pull-through cache of that registry (it expires what it keeps)
        config["proxy"] = {"remoteurl": proxy}
    return config


@dataclasses.dataclass
class EmbeddedRegistry:
    data_dir: Path
    certificate: Path  # the coordinator's token certificate (registry/token.crt)
    port: int = 0
    proxy: str = ""  # set: a pull-through mirror of the registry at this URL
    process: subprocess.Popen[bytes] | None = None
    _guard_proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "registry.pid"

    def start(self, timeout_s: float = 30) -> EmbeddedRegistry:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir = self.data_dir.resolve()
        self._stop_stale()
        self.port = self.port or free_port()  # kept when started again (garbage_collect)
        config = self.data_dir / "config.yml"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:  # JSON is YAML; the upload-state secret is in it
            json.dump(_config(self.data_dir, self.port, self.certificate, self.proxy), f)
        with open(self.data_dir / "registry.log", "ab") as out:
            self.process = subprocess.Popen([registry_binary(), "serve", str(config)],
                                            stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.data_dir,
                                            start_new_session=True)
        self._guard_proc = guard_group(self.process.pid)
        self.pidfile.write_text(json.dumps({"pid": self.process.pid,
                                            "start_time": start_time(self.process.pid)}))
        self._wait_ready(timeout_s)
        return self

    def _stop_stale(self) -> None:
        """A registry left by an owner killed with its guard, on this folder."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded = json.loads(self.pidfile.read_text())
            pid = int(recorded["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if start_time(pid) == recorded["start_time"] and \
                    os.fsencode(self.data_dir / "config.yml") in cmdline:
                log.warning("stopping the registry left running on %s (pid %d)",
                            self.data_dir, pid)
                end_processes([pid], "the registry")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise StorageError(f"the registry exited ({code}); see "
                                   f"{self.data_dir / 'registry.log'}")
            try:
                # 401 with a bearer challenge: up, and asking for our tokens.
                if httpx.get(f"http://{self.address}/v2/", timeout=2).status_code == 401:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise StorageError(f"the registry did not answer on {self.address} in {timeout_s:.0f} s")

    def garbage_collect(self) -> str:
        """Remove the blobs no manifest references any more. The registry is stopped while
        it runs (its own rule: collection with uploads under way can lose layers), then
        started again on the same port."""
        self.stop()
        try:
            done = subprocess.run([registry_binary(), "garbage-collect", "--delete-untagged",
                                   str(self.data_dir / "config.yml")],
                                  capture_output=True, text=True, timeout=600, check=False)
        finally:
            self.start()
        if done.returncode != 0:
            raise StorageError(f"registry garbage collection failed: {done.stderr[-500:]}")
        return done.stdout

    def stop(self) -> None:
        if self.process is not None:
            end_group(self.process, timeout_s=10)
        if self._guard_proc is not None:
            release_guard(self._guard_proc)
            self._guard_proc = None
        self.pidfile.unlink(missing_ok=True)
