"""An agent that knows two coordinators, one dead and one slow for a moment, on a real
coordinator: one late answer must not cost the job its lease (the client does not go back
to the dead coordinator; the renewer tries again soon, not a quarter of a lease later)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from campugrid.agent.client import CoordinatorApi, CoordinatorClient, Membership
from campugrid.agent.messages import Lease
from campugrid.agent.renewer import Renewer
from campugrid.cli.seaweed import EmbeddedS3, free_port
from campugrid.client import Api, Identity, tar_folder
from campugrid.coordinator import server
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol.spec import JobSpec
from tests.support.coordinator import start

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
LEASE_S = 8.0  # renewals every 2 s, each given 2 s; the agent fences itself after 6 s


class StallingProxy:
    """A TCP proxy to a coordinator that can hold every byte for a while: a coordinator too
    busy to answer in time, though it is up."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self, seconds: float) -> None:
        self.flowing.clear()
        threading.Timer(seconds, self.flowing.set).start()

    def close(self) -> None:
        self.flowing.set()
        for s in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                inner, _ = self.listener.accept()
                outer = socket.create_connection(self.target)
                self.sockets += [inner, outer]
                for src, dst in ((inner, outer), (outer, inner)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    running, t = start(s3_server, tmp_path, f"f{tmp_path.name[-8:].lower().replace('_', '')}x",
                       lease_seconds=LEASE_S)
    api = Api(running.url, Identity.load(tmp_path / "admin.json"))
    yield running, api
    api.close()
    running.stop()
    t.join(5)


@pytest.fixture
def proxy(coordinator) -> Iterator[StallingProxy]:
    p = StallingProxy(coordinator[0].grpc_address)
    yield p
    p.close()


def machine(running: server.Running, tmp_path: Path, addresses: list[str]) -> CoordinatorClient:
    """An approved machine that knows `addresses`, in that order, holding the one queued job."""
    c = CoordinatorClient(Membership.join(tmp_path / "m", ",".join(addresses),
                                          running.certificate.fingerprint))
    for _ in range(len(addresses)):  # the first may be the dead one
        with contextlib.suppress(grpc.RpcError):
            c.register("m", pb.Capabilities(runtime="runsc", builder="buildah"))
            break
    running.coord.machines.approve(c.machine_id)
    return c


def lease(c: CoordinatorClient) -> Lease:
    got = c.lease()
    assert got.has_task
    return Lease(job_id=got.job_id, attempt=got.attempt, fencing_token=got.fencing_token,
                 spec_json=got.spec_json, lease_seconds=got.lease_seconds)


def test_a_late_answer_keeps_the_agent_on_the_live_coordinator_not_the_dead_one(
        coordinator, proxy, tmp_path):
    running, api = coordinator
    dead = f"127.0.0.1:{free_port()}"
    c = machine(running, tmp_path, [dead, proxy.address])  # found dead at the first call
    assert c.address == proxy.address
    job = api.submit(tar_folder(HELLO), JobSpec())
    held = lease(c)
    assert held.job_id == job["id"]
    proxy.stall(2.0)
    with pytest.raises(grpc.RpcError) as late:
        c.renew(held.hold, "running", timeout_s=0.5)
    assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert c.address == proxy.address  # not back to the dead one
    time.sleep(2.0)
    assert c.renew(held.hold, "running", timeout_s=5).keep_going
    c.close()


def test_one_late_renewal_beside_a_dead_coordinator_does_not_fence_the_job(
        coordinator, proxy, tmp_path, caplog):
    running, api = coordinator
    dead = f"127.0.0.1:{free_port()}"  # never tried yet: the client learns it is dead late
    c = machine(running, tmp_path, [proxy.address, dead])
    job = api.submit(tar_folder(HELLO), JobSpec())
    held = lease(c)
    assert held.lease_seconds == LEASE_S
    lost: list[str] = []
    renewer = Renewer(CoordinatorApi(c), held, on_lost=lost.append).start()
    try:
        # The first renewal (at 2 s) gets no answer in its 2 s: the client moves to the dead
        # coordinator, fails there, and comes back. Waiting a quarter lease (2 s) after each
        # failure would reach the 6 s fence at the dead one; the retry comes sooner.
        time.sleep(1.0)
        proxy.stall(4.0)  # until 5 s: past the first renewal's deadline (4 s), not the retry (5 s)
        time.sleep(LEASE_S + 1)
        assert lost == []
        assert renewer.reason == ""
    finally:
        renewer.stop()
    said = caplog.text  # the path this test is about was taken: late there, refused here
    assert f"{proxy.address} unreachable (DEADLINE_EXCEEDED)" in said
    assert f"{dead} unreachable (UNAVAILABLE)" in said
    final = api.job(job["id"])
    assert (final["state"], final["attempt"]) == ("building", 1)
    assert "lease_expired" not in [e["kind"] for e in final["events"]]
    c.close()
