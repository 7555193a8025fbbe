"""The coordinator as a task sees it, two ways through one body: the real one (a coordinator
in this process, over signed gRPC with pinned TLS, through client.CoordinatorApi) and the
in-memory fake the agent's unit tests use (agent/fake.py). What the fake answers for a hold
is what the coordinator answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from campugrid.agent.client import CoordinatorApi
from campugrid.agent.fake import FakeCoordinator
from campugrid.agent.messages import Lease, Outcome
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.support.coordinator import client, close_clients, start

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


@dataclasses.dataclass
class Side:
    api: Any  # CoordinatorApi, or the fake
    lease: Callable[[], Lease]  # a new job, leased to this machine
    cancel: Callable[[str], None]  # its owner cancels it


def cases(side: Side) -> dict[str, Any]:
    """What the coordinator answers for a live hold, a stale one, an ended one, and a
    cancelled job's."""
    api, out = side.api, {}
    lease = side.lease()
    hold = lease.hold
    out["kind"] = hold.kind
    out["renew"] = [api.renew(hold, "building", 5).keep_going,
                    api.renew(hold, "running", 5).keep_going]
    out["logs"] = api.logs(hold, "run", 1, "hello\n")
    stale = dataclasses.replace(hold, token=hold.token + 1)
    out["stale"] = [api.renew(stale, "running", 5).keep_going, api.logs(stale, "run", 2, "x\n"),
                    api.complete(stale, Outcome(succeeded=True, exit_code=0)).accepted,
                    api.release(stale, "drained").accepted]
    out["complete"] = api.complete(hold, Outcome(succeeded=True, exit_code=0)).accepted
    out["after_the_end"] = [api.renew(hold, "running", 5).keep_going,
                            api.logs(hold, "run", 3, "late\n"),
                            api.complete(hold, Outcome(succeeded=True, exit_code=0)).accepted,
                            api.release(hold, "drained").accepted,
                            api.begin_checkpoint(hold, 1, 10).accepted]
    second = side.lease()
    out["release"] = [api.release(second.hold, "the owner needs it").accepted,
                      api.renew(second.hold, "running", 5).keep_going]
    side.cancel(second.job_id)  # queued again by the hand-back: out of the next lease's way
    third = side.lease()
    side.cancel(third.job_id)
    renewal = api.renew(third.hold, "running", 5)
    out["cancelled"] = [renewal.keep_going, "cancelled" in renewal.reason]
    return out


EXPECTED = {"kind": "attempt", "renew": [True, True], "logs": True,
            "stale": [False, False, False, False], "complete": True,
            "after_the_end": [False, False, False, False, False],
            "release": [True, False], "cancelled": [False, True]}


@pytest.fixture
def real(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[Side]:
    running, t = start(s3_server, tmp_path, f"k{tmp_path.name[-8:].lower().replace('_', '')}x")
    researcher = Api(running.url, Identity.load(tmp_path / "admin.json"))
    machine = CoordinatorApi(client(running, tmp_path, "contract"))

    def lease() -> Lease:
        job = researcher.submit(tar_folder(HELLO), JobSpec())
        got = machine.lease()
        assert got is not None and got.job_id == job["id"]
        return got

    yield Side(machine, lease, lambda job_id: researcher.cancel(job_id))
    researcher.close()
    close_clients()
    running.stop()
    t.join(5)


def test_the_real_coordinator_answers_so(real: Side):
    assert cases(real) == EXPECTED


def test_the_fake_answers_as_the_real_one_does():
    fake = FakeCoordinator()
    count = iter(range(1, 100))

    def lease() -> Lease:
        return fake.grant(Lease(job_id=f"job-{next(count)}", attempt=1, fencing_token=1,
                                spec_json="{}"))

    assert cases(Side(fake, lease, fake.cancel)) == EXPECTED
