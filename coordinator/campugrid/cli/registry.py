"""The embedded OCI registry that `campugrid up` and the tests start: Debian's
`docker-registry` (the CNCF distribution registry), on 127.0.0.1, storing on disk; and the
same program as a pull-through mirror of Docker Hub (coordinator/bases.py).

It accepts only bearer tokens the coordinator signs (coordinator/registry.py): a machine can
push the one repository its task builds and pull the one it was told to, and nothing lists
the catalogue. Deleting manifests is on, for the coordinator's garbage collection. At scale
any registry configured the same way replaces it (docs/jobs.md: "Shared images").
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import ClassVar

import httpx

from campugrid.cli.daemon import Daemon
from campugrid.cli.seaweed import free_port
from campugrid.coordinator.registry import ISSUER, SERVICE
from campugrid.protocol.errors import StorageError


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


def _answers_with_a_challenge(address: str) -> bool:
    """Up, and asking for our tokens: 401 with a bearer challenge."""
    try:
        return httpx.get(f"http://{address}/v2/", timeout=2).status_code == 401
    except httpx.HTTPError:
        return False


@dataclasses.dataclass
class EmbeddedRegistry(Daemon):
    certificate: Path  # the coordinator's token certificate (registry/token.crt)
    port: int = 0
    proxy: str = ""  # set: a pull-through mirror of the registry at this URL
    what: ClassVar[str] = "the registry"
    name: ClassVar[str] = "registry"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30) -> EmbeddedRegistry:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir = self.data_dir.resolve()
        config = self.data_dir / "config.yml"
        self._stop_stale(config)
        self.port = self.port or free_port()  # kept when started again (garbage_collect)
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:  # JSON is YAML; the upload-state secret is in it
            json.dump(_config(self.data_dir, self.port, self.certificate, self.proxy), f)
        self._launch([registry_binary(), "serve", str(config)])
        self._wait_ready(lambda: _answers_with_a_challenge(self.address), self.address,
                         timeout_s)
        return self

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
