"""Sharded jobs in the store: sessions, per-shard results, heavy/light, loss and fencing,
on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from campugrid.coordinator.store import Store
from campugrid.coordinator.views import ShardResult, utcnow
from campugrid.protocol.errors import Conflict, StaleAttempt
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.holds import session
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


def sharded(store: Store, costs: list[float], client_id: str | None = None, **extra: object):
    spec = {"command": ["python3", "work.py"], "max_attempts": 2,
            "shards": [{"payload": {"n": i}, "cost": c} for i, c in enumerate(costs)], **extra}
    if client_id:
        spec["client_job_id"] = client_id
    job, _ = store.submit(JobSpec.from_dict(spec), "contexts/x.tar", "ab" * 32)
    return job


def ok(index: int, value: object) -> ShardResult:
    return ShardResult(index, True, 0, json.dumps(value), None)


def test_every_shard_is_a_task_with_its_own_result(store: Store):
    job = sharded(store, [1, 1, 1])
    assert job.state is JobState.QUEUED and job.shards_total == 3 and job.shards_queued == 3
    assert job.spec.shards == ()  # stored apart from the spec
    m = add_machine(store, "m", {})
    claim = store.claim(m, 30)
    assert claim is not None and claim.session is not None and claim.shard is not None
    token, first = claim.token, claim.shard
    assert token == claim.session and claim.hold(m) == session(job.id, token, m)
    # equal costs: a fast machine takes them from the end, a slow one from the start
    assert json.loads(first.payload_json) == {"n": 2}
    seen = [first.index]
    task = store.shards.next_shard(session(job.id, token, m), ok(first.index, first.index * 10),
                                   heavy_first=True)
    while task is not None:
        seen.append(task.index)
        assert store.get(job.id).state is (JobState.RUNNING if len(seen) == 3 else JobState.QUEUED)
        task = store.shards.next_shard(session(job.id, token, m), ok(task.index, task.index * 10),
                                       heavy_first=True)
    assert sorted(seen) == [0, 1, 2]
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and done.result == "3 of 3 shards succeeded"
    assert [(s.index, s.state, s.result) for s in store.shards.shards(job.id)] == [
        (0, "succeeded", 0), (1, "succeeded", 10), (2, "succeeded", 20)]
    # The session's last log lines may come after the job's end closed it.
    store.shards.append_logs(session(job.id, token, m), "run", 1, "the last line")
    assert [c.text for c in store.logs(job.id)] == ["the last line"]
    store.shards.end(session(job.id, token, m), failure=None)  # already closed by the job's end
    assert store.claim(m, 30) is None


def test_a_failed_shard_fails_the_job_but_every_shard_runs(store: Store):
    job = sharded(store, [1, 1])
    m = add_machine(store, "m", {})
    claim = store.claim(m, 30)
    assert claim is not None and claim.shard is not None
    nxt = store.shards.next_shard(session(job.id, claim.token, m),
                                  ShardResult(claim.shard.index, False, 3, None, "exit status 3"),
                                  heavy_first=True)
    assert nxt is not None
    assert store.shards.next_shard(session(job.id, claim.token, m), ok(nxt.index, "x"),
                                   heavy_first=True) is None
    done = store.get(job.id)
    assert done.state is JobState.FAILED and done.shards_failed == 1
    assert done.reason is not None and f"shard {claim.shard.index}: exit status 3" in done.reason


def test_heavy_shards_go_to_fast_machines_and_light_ones_to_slow(store: Store):
    job = sharded(store, [5, 1, 9, 3])
    fast = add_machine(store, "fast", {})
    slow = add_machine(store, "slow", {})
    f = store.claim(fast, 30, heavy_first=True)
    s = store.claim(slow, 30, heavy_first=False)
    assert f is not None and s is not None and f.shard is not None and s.shard is not None
    assert (f.shard.cost, s.shard.cost) == (9, 1)
    nf = store.shards.next_shard(session(job.id, f.token, fast), ok(f.shard.index, 1), heavy_first=True)
    ns = store.shards.next_shard(session(job.id, s.token, slow), ok(s.shard.index, 1), heavy_first=False)
    assert nf is not None and ns is not None and (nf.cost, ns.cost) == (5, 3)


def test_a_lost_session_requeues_its_shard_and_its_late_result_is_refused(store: Store):
    job = sharded(store, [1, 1])
    lost = add_machine(store, "lost", {})
    other = add_machine(store, "other", {})
    claim = store.claim(lost, 5)
    assert claim is not None and claim.shard is not None
    held = claim.shard.index
    assert store.requeue_expired(utcnow() + dt.timedelta(seconds=10)) == [job.id]
    assert store.get(job.id).shards_queued == 2
    with pytest.raises(StaleAttempt, match="session is over"):
        store.shards.next_shard(session(job.id, claim.token, lost), ok(held, "late"), heavy_first=True)
    with pytest.raises(StaleAttempt):
        store.shards.renew(session(job.id, claim.token, lost), 30)
    with pytest.raises(StaleAttempt, match="lease expired"):
        store.shards.append_logs(session(job.id, claim.token, lost), "run", 1, "late line")
    again = store.claim(other, 30)
    assert again is not None and again.shard is not None
    shard = {s.index: s for s in store.shards.shards(job.id)}[held]
    assert shard.tries == 1 and shard.state in ("queued", "running")
    assert "session_lost" in [e.kind for e in store.events(job.id)]


def test_a_shard_lost_max_attempts_times_fails(store: Store):
    job = sharded(store, [1])  # max_attempts 2
    m = add_machine(store, "m", {})
    for _ in range(2):
        claim = store.claim(m, 5)
        assert claim is not None
        store.requeue_expired(utcnow() + dt.timedelta(seconds=10))
    done = store.get(job.id)
    assert done.state is JobState.FAILED
    assert "all 2 tries used" in (done.reason or "")


def test_a_drained_session_does_not_count_a_try(store: Store):
    job = sharded(store, [1])
    m = add_machine(store, "m", {})
    for _ in range(3):  # more than max_attempts
        claim = store.claim(m, 30)
        assert claim is not None
        store.shards.release(session(job.id, claim.token, m), "shutting down", failed=False)
    assert store.shards.shards(job.id)[0].tries == 0
    assert store.get(job.id).state is JobState.QUEUED


def test_a_failed_session_fails_the_job_with_its_reason(store: Store):
    job = sharded(store, [1, 1, 1])
    m = add_machine(store, "m", {})
    claim = store.claim(m, 30)
    assert claim is not None
    store.shards.end(session(job.id, claim.token, m), failure="the image does not build")
    done = store.get(job.id)
    assert done.state is JobState.FAILED and done.reason == "the image does not build"
    assert {s.state for s in store.shards.shards(job.id)} == {"cancelled"}
    assert store.claim(m, 30) is None


def test_cancel_ends_sessions(store: Store):
    job = sharded(store, [1, 1])
    m = add_machine(store, "m", {})
    claim = store.claim(m, 30)
    assert claim is not None and claim.shard is not None
    store.cancel(job.id)
    with pytest.raises(StaleAttempt):
        store.shards.next_shard(session(job.id, claim.token, m), ok(claim.shard.index, 1),
                                heavy_first=True)
    assert store.claim(m, 30) is None


def test_resubmitting_with_other_shards_conflicts(store: Store):
    first = sharded(store, [1, 2], client_id="sweep")
    again = sharded(store, [1, 2], client_id="sweep")
    assert again.id == first.id
    with pytest.raises(Conflict):
        sharded(store, [1, 3], client_id="sweep")


def test_many_machines_never_take_one_shard_twice(store: Store):
    n = 60
    job = sharded(store, [1.0] * n)
    machines = [add_machine(store, f"m{i}", {}) for i in range(6)]
    taken: list[int] = []
    lock = threading.Lock()

    def work(m: str) -> None:
        claim = store.claim(m, 30)
        if claim is None or claim.shard is None:
            return
        task = claim.shard
        while task is not None:
            with lock:
                taken.append(task.index)
            task = store.shards.next_shard(session(job.id, claim.token, m), ok(task.index, m),
                                           heavy_first=True)
        store.shards.end(session(job.id, claim.token, m), failure=None)

    with ThreadPoolExecutor(len(machines)) as pool:
        list(pool.map(work, machines))
    assert sorted(taken) == list(range(n))
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and done.shards_done == n


def test_a_sharded_gpu_job_holds_gpu_memory_per_session_until_the_job_ends(store: Store):
    from campugrid.coordinator.scheduler import GpuView, MachineView

    spec = {"command": ["x"], "resources": {"gpus": 1, "gpu_memory_mb": 4096},
            "shards": [{"payload": i} for i in range(2)]}
    job, _ = store.submit(JobSpec.from_dict(spec), "contexts/x.tar", "ab" * 32)
    m = add_machine(store, "gpu-box", {})
    offer = MachineView(m, "gpu-box", (GpuView("GPU-1", "nvidia", "RTX", 10_000, 0, (8, 6)),),
                        gpu_isolation=True)
    claim = store.claim(m, 30, offer)
    assert claim is not None and claim.gpu_uuids == ("GPU-1",) and claim.shard is not None
    assert store.reserved_gpus(job.id, claim.session) == ["GPU-1"]
    nxt = store.shards.next_shard(session(job.id, claim.token, m), ok(claim.shard.index, 1),
                                  heavy_first=True)
    assert nxt is not None
    assert store.shards.next_shard(session(job.id, claim.token, m), ok(nxt.index, 2),
                                   heavy_first=True) is None
    assert store.get(job.id).state is JobState.SUCCEEDED
    assert store.reserved_gpus(job.id, claim.session) == []
