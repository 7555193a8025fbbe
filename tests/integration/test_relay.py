"""Work across coordinator processes on one PostgreSQL: a job submitted through one process
reaches a machine whose stream is open to another at once (LISTEN/NOTIFY, coordinator/wakeup.py),
not at that process's own look for work (fleet.RECHECK_S)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity, tar_folder
from campugrid.coordinator import fleet, server
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol.spec import JobSpec
from tests.support.coordinator import client, close_clients, start

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


@pytest.fixture
def two(s3_server: EmbeddedS3, tmp_path: Path, database: str, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[tuple[server.Running, server.Running]]:
    monkeypatch.setattr(fleet, "RECHECK_S", 60.0)  # the dispatchers look only when told
    bucket = f"h{secrets.token_hex(6)}"
    a, ta = start(s3_server, tmp_path / "a", bucket, database_url=database)
    b, tb = start(s3_server, tmp_path / "b", bucket, database_url=database)
    yield a, b
    close_clients()
    for running, t in ((a, ta), (b, tb)):
        running.stop()
        t.join(5)


def test_work_submitted_through_one_process_reaches_a_machine_connected_to_another(two, tmp_path):
    a, b = two
    assert a.relay is not None and b.relay is not None
    assert b.relay.listening.wait(10), "the second process never listened"
    assert b.service is not None
    m = client(b, tmp_path, "m")
    got: list[pb.LeaseReply] = []
    waiting = threading.Thread(target=lambda: got.append(m.lease(wait_s=15)))
    waiting.start()
    deadline = time.monotonic() + 10
    while not list(b.service.fleet.idle()):
        assert time.monotonic() < deadline, "the machine's stream never said it was ready"
        time.sleep(0.05)
    with Api(a.url, Identity.load(tmp_path / "a" / "admin.json")) as api:
        began = time.monotonic()
        job = api.submit(tar_folder(HELLO), JobSpec())
        waiting.join(10)
    assert got and got[0].has_task and got[0].job_id == job["id"], got
    assert time.monotonic() - began < 5  # a's NOTIFY, not b's own look a minute later
