"""Held asks for work across coordinator processes on one PostgreSQL: work submitted through
one process wakes the asks held by another at once (LISTEN/NOTIFY, coordinator/wakeup.py),
not at their own look a second later."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity, tar_folder
from campugrid.coordinator import server
from campugrid.coordinator.services import leasing
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol.spec import JobSpec
from tests.support.coordinator import client, close_clients, held, start

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


@pytest.fixture
def two(s3_server: EmbeddedS3, tmp_path: Path, database: str
        ) -> Iterator[tuple[server.Running, server.Running]]:
    bucket = f"h{secrets.token_hex(6)}"
    a, ta = start(s3_server, tmp_path / "a", bucket, database_url=database)
    b, tb = start(s3_server, tmp_path / "b", bucket, database_url=database)
    yield a, b
    close_clients()
    for running, t in ((a, ta), (b, tb)):
        running.stop()
        t.join(5)


def test_work_submitted_through_one_process_wakes_an_ask_held_by_another(two, tmp_path,
                                                                          monkeypatch):
    a, b = two
    monkeypatch.setattr(leasing, "RECHECK_S", 60.0)  # held calls look only when told
    assert a.relay is not None and b.relay is not None
    assert b.relay.listening.wait(10), "the second process never listened"
    m = client(b, tmp_path, "m")
    ask = m.stub.Lease.future(pb.LeaseRequest(wait_ms=15_000), timeout=30)
    held(b, 1)
    with Api(a.url, Identity.load(tmp_path / "a" / "admin.json")) as api:
        job = api.submit(tar_folder(HELLO), JobSpec())
        reply = ask.result(timeout=10)  # woken by a's NOTIFY, not by the end of its 15 s
    assert reply.has_task and reply.job_id == job["id"], reply
