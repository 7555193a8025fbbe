"""The coordinator's services on a real database and the in-memory object store
(objects.MemoryObjects, held to S3 by test_objects.py): what a machine reports about a job's
output is checked against what storage holds before a researcher is pointed at it."""

from __future__ import annotations

import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from campugrid.coordinator.config import Settings
from campugrid.coordinator.objects import MemoryObjects
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.services import leasing
from campugrid.coordinator.store import Store
from campugrid.protocol.errors import NotFound
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


def coordinator(store: Store, tmp_path: Path) -> tuple[Coordinator, MemoryObjects]:
    objects = MemoryObjects()
    return Coordinator(Settings(tmp_path, "sqlite://", "", "", ""), store, objects), objects


def test_an_output_the_machine_claims_but_storage_lacks_is_never_shown(store: Store, tmp_path):
    coord, objects = coordinator(store, tmp_path)
    machine = add_machine(store, "m")
    for _ in range(2):
        store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)
    claimed = coord.leasing.lease(machine)
    assert claimed is not None and claimed.output_url.startswith("memory://")
    coord.leasing.complete(claimed.hold, succeeded=True, exit_code=0, reason=None, result="1",
                           output_uploaded=True, limits={})  # said so, sent nothing
    job = coord.jobs.get(claimed.job.id)
    assert job.state is JobState.SUCCEEDED and job.output_key is None
    with pytest.raises(NotFound, match="has no output"):
        coord.jobs.open_output(job.id)
    uploaded = coord.leasing.lease(machine)
    assert uploaded is not None and uploaded.job.id != job.id
    objects.accept(uploaded.output_url, b"the output archive")  # the agent's presigned PUT
    coord.leasing.complete(uploaded.hold, succeeded=True, exit_code=0, reason=None, result="2",
                           output_uploaded=True, limits={},
                           output_files=[("out/\x1bfile", 18)])
    shown, stream = coord.jobs.open_output(uploaded.job.id)
    assert b"".join(stream) == b"the output archive"
    assert shown.output_files == (("out/?file", 18),)  # as said, printable


def test_a_replicas_output_is_read_where_its_upload_url_cannot_change_it(store: Store, tmp_path):
    from tests.unit.test_quorum import archive

    coord, objects = coordinator(store, tmp_path)
    parent, _ = store.submit(JobSpec.from_dict({"verify": {"replicas": 2}}), "contexts/x.tar",
                             "ab" * 32)
    honest = archive([("answer.txt", b"42\n")])
    leases = []
    for name in ("a", "b"):
        lease = coord.leasing.lease(add_machine(store, name))
        assert lease is not None and lease.job.replica_of == parent.id
        objects.accept(lease.output_url, b"".join(honest))
        leases.append(lease)
    # A call that moved the archive and then broke: its retry finds it moved, and reads it.
    coord.leasing._keep_output(coord.leasing.output_key(leases[0].job.id, 1))
    coord.leasing.complete(leases[0].hold, succeeded=True, exit_code=0, reason=None, result="42",
                           output_uploaded=True, limits={}, output_files=[("lies.txt", 1)])
    coord.leasing.complete(leases[1].hold, succeeded=True, exit_code=0, reason=None, result="42",
                           output_uploaded=True, limits={})
    job = coord.jobs.get(parent.id)
    assert job.state is JobState.SUCCEEDED and job.output_files == (("answer.txt", 3),)
    objects.accept(leases[0].output_url, b"swapped after the vote")  # its URL still works...
    _, stream = coord.jobs.open_output(job.id)
    assert b"".join(stream) == b"".join(honest)  # ...but not on what was compared


def test_a_checkpoint_downloaded_by_epoch_is_never_one_a_check_set_aside(store: Store, tmp_path):
    from sqlalchemy import update

    from campugrid.coordinator.models import Checkpoint
    from tests.support.holds import attempt

    coord, objects = coordinator(store, tmp_path)
    job, _ = store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)
    machine = add_machine(store, "m")
    for token, data in ((1, b"good"), (2, b"poisoned")):
        held = store.claim_next(machine, lease_s=30)
        assert held is not None and held.attempt == token
        key = f"checkpoints/{job.id}/{token}"
        objects.put_bytes(key, data)
        store.checkpoints.record(attempt(job.id, token, machine), epoch=3, key=key, size=1,
                                sha256="0" * 64, keep=5)
        store.release(attempt(job.id, token, machine), "drained")
    with store.tx() as s:  # the second attempt's epoch 3 lost its check
        s.execute(update(Checkpoint).where(Checkpoint.attempt == 2).values(verdict="rejected"))
    shown, stream = coord.jobs.open_checkpoint(job.id, 3)
    assert shown.attempt == 1 and b"".join(stream) == b"good"


def test_a_comparison_is_leased_with_the_two_outputs_as_the_coordinator_kept_them(
        store: Store, tmp_path):
    import hashlib

    from tests.unit.test_quorum import archive

    coord, objects = coordinator(store, tmp_path)
    parent, _ = store.submit(JobSpec.from_dict({"verify": {"replicas": 2, "compare": "./cmp"}}),
                             "contexts/x.tar", "ab" * 32)
    kept = {}
    for name, stamp in (("a", b"12:00"), ("b", b"12:01")):
        lease = coord.leasing.lease(add_machine(store, name))
        assert lease is not None
        data = b"".join(archive([("answer.txt", b"42\n"), ("when.txt", stamp)]))
        objects.accept(lease.output_url, data)
        coord.leasing.complete(lease.hold, succeeded=True, exit_code=0, reason=None,
                               result="42", output_uploaded=True, limits={})
        kept[lease.job.id] = data
    judging = coord.leasing.lease(add_machine(store, "judge"))
    assert judging is not None and judging.job.compare_pair is not None
    assert coord.jobs.get(parent.id).state is JobState.RUNNING  # until the command says
    assert judging.job.spec.command == ("sh", "-c", "./cmp") and judging.output_url
    for name, replica in zip("ab", judging.job.compare_pair, strict=True):
        [f] = judging.datasets[name]
        assert f.path == "output.tar.gz" and f.size == len(kept[replica])
        assert f.sha256 == hashlib.sha256(kept[replica]).hexdigest()
        key = urllib.parse.unquote(urllib.parse.urlsplit(f.url).path.lstrip("/"))
        assert key == store.get(replica).output_key and "method=GET" in f.url
        assert objects.get_bytes(key) == kept[replica]


def test_a_checkpoint_comparison_is_leased_with_both_checkpoints_as_uploaded(store: Store,
                                                                             tmp_path):
    from tests.support.holds import attempt

    coord, objects = coordinator(store, tmp_path)
    spec = JobSpec.from_dict({"verify": {"checkpoints": 1, "compare": "./cmp"}})
    store.submit(spec, "contexts/x.tar", "ab" * 32)
    uploaded = {}
    for name in ("maker", "checker"):
        lease = coord.leasing.lease(add_machine(store, name))
        assert lease is not None
        key, data = f"checkpoints/{lease.job.id}/{name}.tar", f"{name}'s epoch 0".encode()
        objects.put_bytes(key, data)
        store.checkpoints.record(attempt(lease.job.id, 1, lease.hold.machine_id), epoch=0,
                                key=key, size=len(data), sha256="0" * 64, keep=3,
                                content_digest=f"sha256:{name}")
        uploaded[key] = data
    judging = coord.leasing.lease(add_machine(store, "judge"))
    assert judging is not None and judging.job.compare_pair is not None
    got = {}
    for name in "ab":
        [f] = judging.datasets[name]
        assert f.path == "checkpoint.tar"
        key = urllib.parse.unquote(urllib.parse.urlsplit(f.url).path.lstrip("/"))
        got[key] = objects.get_bytes(key)
    assert got == uploaded


def test_the_speeds_of_machines_online_are_read_as_online_reads_them(store: Store, tmp_path):
    given = {add_machine(store, name, {"speed_gflops": speed}): speed
             for name, speed in (("a", 10.0), ("b", 200.0), ("c", 0.0))}
    add_machine(store, "pending", {"speed_gflops": 99.0}, approve=False)
    assert store.machines.speeds() == {m.id: m.speed for m in store.machines.online()} == given
    one = next(iter(given))
    assert store.machines.speeds(only=one) == {one: given[one]}


def test_a_claim_does_not_wait_for_the_speed_ranking_and_a_newcomer_is_ranked_by_its_own(
        store: Store, tmp_path, monkeypatch):
    """Every claim asks whether its machine is fast (sharded jobs' heavy shards go to the
    faster half); the ranking reads every machine online, about 0.3 s at 10,000 (bench/fleet.py):
    made again beside the claims, never in one."""
    coord, _ = coordinator(store, tmp_path)
    slow = add_machine(store, "slow", {"speed_gflops": 10.0})
    coord.leasing.rank_speeds()
    fast = add_machine(store, "fast", {"speed_gflops": 200.0})  # came after the ranking
    assert coord.leasing.is_fast(fast) and not coord.leasing.is_fast(slow)

    real, reading, read = store.machines.speeds, threading.Event(), threading.Event()
    release = threading.Event()

    def slow_ranking(within_s: float = 30, only: str | None = None) -> dict[str, float]:
        if only is None:  # the whole ranking: held until the test lets it go
            reading.set()
            release.wait(10)
            try:
                return real(within_s)
            finally:
                read.set()
        return real(within_s, only)

    monkeypatch.setattr(store.machines, "speeds", slow_ranking)
    monkeypatch.setattr(leasing, "SPEEDS_REFRESH_S", 0.0)  # the ranking is old now
    faster = add_machine(store, "faster", {"speed_gflops": 400.0})
    assert coord.leasing.is_fast(faster) and not coord.leasing.is_fast(slow)
    assert reading.wait(5)  # the new ranking is being made...
    assert not read.is_set()  # ...and the claims did not wait for it
    release.set()
    assert read.wait(5)
    deadline = time.monotonic() + 5
    while coord.leasing._ranking.locked():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted(coord.leasing._speeds.values()) == [10.0, 200.0, 400.0]
