"""A coordinator in the test's own process: server.start, its REST API on a thread.

Its ports cannot be taken by anything else before it listens: REST on a socket bound here
and handed to uvicorn, gRPC on a port the kernel picks. (Ports found free a moment earlier
sometimes were not by the time the server bound them, and a REST thread that failed to bind
left the test waiting.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from campugrid.agent.client import CoordinatorClient, Membership
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity
from campugrid.coordinator import server
from campugrid.coordinator.config import Settings
from campugrid.protocol import agent_pb2 as pb


def start(s3: EmbeddedS3, root: Path, bucket: str,
          **overrides: object) -> tuple[server.Running, threading.Thread]:
    """A coordinator with its state under `root` (its admin identity root/admin.json) on
    `bucket`, lease_seconds 30 unless `overrides` say otherwise; once REST answers."""
    rest = socket.socket()
    rest.bind(("127.0.0.1", 0))
    settings = Settings.from_env(
        root / "coord", s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key, s3_bucket=bucket, http_port=rest.getsockname()[1],
        grpc_port=0, admin_identity=root / "admin.json", **{"lease_seconds": 30.0, **overrides})
    running = server.start(settings)
    t = threading.Thread(target=running.http.run, kwargs={"sockets": [rest]}, daemon=True,
                         name="rest")
    t.start()
    deadline = time.monotonic() + 60
    while not running.http.started:
        if not t.is_alive() or time.monotonic() > deadline:
            running.stop()
            raise RuntimeError(f"the coordinator's REST API did not start on {running.url}")
        time.sleep(0.05)
    return running, t


@contextlib.contextmanager
def with_api(s3: EmbeddedS3, root: Path, prefix: str,
             **overrides: object) -> Iterator[tuple[server.Running, Api]]:
    """start(), on a bucket named after `root` (tests' tmp_path), with the admin's REST API;
    stopped after, with the machines client() made."""
    running, t = start(s3, root, f"{prefix}{root.name[-8:].lower().replace('_', '')}x",
                       **overrides)
    api = Api(running.url, Identity.load(root / "admin.json"))
    try:
        yield running, api
    finally:
        api.close()
        close_clients()
        running.stop()
        t.join(5)


_clients: list[CoordinatorClient] = []


def client(running: server.Running, tmp_path: Path, name: str,
           caps: pb.Capabilities | None = None, approve: bool = True) -> CoordinatorClient:
    """A machine that joined (pinning the coordinator's certificate) and, unless told
    otherwise, was approved by its owner; closed by close_clients(). Its lease() claims at
    once with a Lease call, or with wait_s waits on its stream as the agent does."""
    membership = Membership.join(tmp_path / name, running.grpc_address,
                                 running.certificate.fingerprint)
    c = CoordinatorClient(membership)
    _clients.append(c)
    c.register(name, caps or pb.Capabilities(runtime="runsc", builder="buildah"))
    if approve:
        running.coord.machines.approve(c.machine_id)
    return c


def close_clients() -> None:
    for c in _clients:
        c.close()
    _clients.clear()
