"""Verified jobs in the store, on SQLite and on a real PostgreSQL: replicas on different
machines, a quorum's answer taken, more replicas on disagreement, the liar quarantined and
its earlier results marked tainted."""

from __future__ import annotations

import json

import pytest

from campugrid.coordinator import verified
from campugrid.coordinator.machines import Status
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import JobView, ShardResult, utcnow
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.holds import attempt
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration
RIGHT, WRONG = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def submit(store: Store, **spec: object) -> JobView:
    return store.submit(JobSpec.from_dict(dict(spec)), "contexts/x.tar", "ab" * 32)[0]


def run(store: Store, machine: str, *, result: str = "42", digest: str = RIGHT,
        exit_code: int = 0) -> JobView:
    """The machine takes the next job it may and finishes it with this answer."""
    job = store.claim_next(machine, lease_s=30)
    assert job is not None, f"machine {machine[:8]} was given nothing"
    return store.finish(attempt(job.id, job.attempt, machine), succeeded=exit_code == 0,
                        exit_code=exit_code, reason=None, result=result, output_key=None,
                        limits={}, output_digest=digest)


def test_replicas_run_on_different_machines_and_a_quorum_decides(store: Store):
    job = submit(store, verify={"replicas": 2})
    assert job.state is JobState.QUEUED and job.replicas == 2
    assert [j.id for j in store.list_jobs()] == [job.id]  # replicas show on their job only
    m1, m2 = add_machine(store, "m1"), add_machine(store, "m2")
    first = store.claim_next(m1, lease_s=30)
    assert first is not None and first.replica_of == job.id and first.spec.verify is None
    assert store.claim_next(m1, lease_s=30) is None  # never two replicas on one machine
    assert store.get(job.id).state is JobState.RUNNING
    store.finish(attempt(first.id, 1, m1), succeeded=True, exit_code=0, reason=None,
                 result="42", output_key="outputs/a", limits={}, output_digest=RIGHT)
    assert store.get(job.id).state is JobState.RUNNING  # one answer is not a quorum
    run(store, m2)
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and done.result == "42"
    assert done.output_key == "outputs/a" and done.machine_id == m1
    for m in (m1, m2):
        record = store.machines.get(m)
        assert (record.agreed, record.streak, record.status) == (1, 1, Status.APPROVED)
    assert [e.kind for e in store.events(job.id)][-1] == "verified"


def test_a_liar_is_outvoted_quarantined_and_its_earlier_results_tainted(store: Store):
    m1, liar, m3 = (add_machine(store, n) for n in ("m1", "liar", "m3"))
    earlier = submit(store)  # a plain job the liar runs before it is caught
    assert run(store, liar).id == earlier.id
    job = submit(store, verify={"replicas": 2})
    run(store, m1)
    run(store, liar, result="41", digest=WRONG)
    assert store.get(job.id).state is JobState.RUNNING and store.get(job.id).replicas == 3
    assert store.claim_next(m1, lease_s=30) is None and store.claim_next(liar, lease_s=30) is None
    run(store, m3)
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and done.result == "42"
    record = store.machines.get(liar)
    assert record.status is Status.QUARANTINED and record.disagreed == 1 and record.streak == 0
    assert "41" in record.quarantine and job.id in record.quarantine
    assert store.get(earlier.id).tainted and "quarantined" in (store.get(earlier.id).tainted or "")
    assert not store.get(job.id).tainted
    answers = {r.machine_id: r.result for r in store.replicas(job.id)}
    assert answers == {m1: "42", liar: "41", m3: "42"}
    # An admin reinstates it: it earns trust again from nothing.
    store.machines.set_status(liar, Status.APPROVED)
    assert store.machines.get(liar).quarantine == ""


def test_results_that_never_reach_a_quorum_fail_the_job_with_every_answer(store: Store):
    job = submit(store, verify={"replicas": 2, "max_replicas": 3})
    ms = [add_machine(store, f"m{i}") for i in range(3)]
    for i, m in enumerate(ms):
        run(store, m, result=str(i), digest=f"sha256:{i}")
    done = store.get(job.id)
    assert done.state is JobState.FAILED and done.reason is not None
    assert done.reason.startswith("results disagree") and all(f"'{i}'" in done.reason for i in range(3))
    assert all(store.machines.get(m).status is Status.APPROVED for m in ms)  # no one is blamed


def test_replicas_still_running_are_cancelled_once_agreement_is_out_of_reach(store: Store):
    job = submit(store, verify={"replicas": 3, "quorum": 3, "max_replicas": 3})
    m1, m2, m3 = (add_machine(store, n) for n in ("m1", "m2", "m3"))
    run(store, m1, result="1")
    still = store.claim_next(m3, lease_s=30)
    run(store, m2, result="2")
    assert store.get(job.id).state is JobState.FAILED
    assert still is not None and store.get(still.id).state is JobState.CANCELLED


def test_an_answer_agreed_on_may_be_a_failure(store: Store):
    job = submit(store, verify={"replicas": 2})
    for name in ("m1", "m2"):
        run(store, add_machine(store, name), exit_code=3, result="")
    done = store.get(job.id)
    assert done.state is JobState.FAILED and done.exit_code == 3


def test_a_replica_that_ends_without_an_answer_is_replaced(store: Store):
    job = submit(store, verify={"replicas": 2}, max_attempts=1)
    m1, m2, m3 = (add_machine(store, n) for n in ("m1", "m2", "m3"))
    lost = store.claim_next(m1, lease_s=30)
    assert lost is not None
    store.release(attempt(lost.id, 1, m1), "disk broke", failed=True)  # its only attempt
    assert store.get(lost.id).state is JobState.FAILED and store.get(job.id).replicas == 3
    run(store, m2)
    run(store, m3)
    assert store.get(job.id).state is JobState.SUCCEEDED


def test_machines_behind_one_address_count_as_one_host_but_loopback_does_not(store: Store):
    job = submit(store, verify={"replicas": 2})
    a = add_machine(store, "home-1", address="198.51.100.7")
    b = add_machine(store, "home-2", address="198.51.100.7")
    assert store.claim_next(a, lease_s=30) is not None
    assert store.claim_next(b, lease_s=30) is None
    local1 = add_machine(store, "local-1", address="127.0.0.1")
    assert store.claim_next(local1, lease_s=30) is not None
    assert len({r.machine_id for r in store.replicas(job.id)}) == 2


def test_machines_an_admin_said_share_an_owner_count_as_one_party(store: Store):
    job = submit(store, verify={"replicas": 2})
    a, b, c = (add_machine(store, n, approve=False) for n in ("desk", "laptop", "other"))
    store.machines.set_status(a, Status.APPROVED, owner="alice")
    store.machines.set_status(b, Status.APPROVED, owner="alice")
    store.machines.set_status(c, Status.APPROVED, owner="bob")
    assert store.machines.get(b).owner == "alice"
    assert store.claim_next(a, lease_s=30) is not None
    assert store.claim_next(b, lease_s=30) is None  # alice answered already
    assert store.claim_next(c, lease_s=30) is not None
    assert {r.machine_id for r in store.replicas(job.id)} == {a, c}
    store.machines.set_status(b, Status.APPROVED)  # reinstated without saying: still alice's
    assert store.machines.get(b).owner == "alice"
    # A shard's copies and a checkpoint's checks are kept apart the same way.
    sweep = submit(store, verify={"replicas": 2}, command="x",
                   shards=[{"payload": 1}])
    assert work_through(store, a) == [0]
    assert work_through(store, b) == []
    assert work_through(store, c) == [0] and store.get(sweep.id).state is JobState.SUCCEEDED
    checked = submit(store, verify={"checkpoints": 1})
    held = store.claim_next(a, lease_s=30)
    assert held is not None and held.id == checked.id
    store.checkpoints.record(attempt(checked.id, held.attempt, a), epoch=0, key="k", size=1,
                            sha256="0" * 64, keep=3, content_digest="sha256:x")
    assert store.claim(b, 30) is None and store.claim(c, 30) is not None


def compare(store: Store, machine: str, exit_code: int) -> JobView:
    """The machine takes the next job, a comparison, and its command exits so."""
    claim = store.claim(machine, 30)
    assert claim is not None and claim.job.compare_pair is not None, claim
    store.finish(attempt(claim.job.id, claim.job.attempt, machine), succeeded=exit_code == 0,
                 exit_code=exit_code, reason=None, result=None, output_key=None, limits={})
    return claim.job


def test_a_compare_command_judges_replicas_that_exited_alike_with_other_outputs(store: Store):
    job = submit(store, verify={"replicas": 2, "compare": ["python3", "cmp.py"]})
    m1, m2, m3, m4 = (add_machine(store, f"m{i}") for i in range(1, 5))
    run(store, m1, digest="sha256:1", result="loss 0.1")
    run(store, m2, digest="sha256:2", result="loss 0.1000001")
    assert store.get(job.id).state is JobState.RUNNING
    assert [j.id for j in store.list_jobs()] == [job.id]
    # Not on a machine that ran a replica: a party to the comparison would judge itself.
    assert store.claim(m1, 30) is None and store.claim(m2, 30) is None
    judged = compare(store, m3, 0)
    assert judged.spec.command == ("python3", "cmp.py") and judged.spec.verify is None
    env = dict(judged.spec.env)
    assert {env["COMPARE_RESULT_A"], env["COMPARE_RESULT_B"]} == {"loss 0.1", "loss 0.1000001"}
    assert set(judged.compare_pair or ()) == {r.id for r in store.replicas(job.id)}
    # "Alike" takes two judges' word: one dishonest judge cannot make a lie pass alone.
    assert store.get(job.id).state is JobState.RUNNING and store.claim(m3, 30) is None
    compare(store, m4, 0)
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and store.machines.get(m1).agreed == 1
    assert store.machines.get(m2).agreed == 1
    assert store.claim(add_machine(store, "m5"), 30) is None


def test_a_comparison_that_never_answers_blames_no_one_and_an_unjudged_replica_is_not_against(
        store: Store):
    job = submit(store, verify={"replicas": 3, "quorum": 2, "compare": "./cmp"})
    a, b, c = (add_machine(store, n) for n in "abc")
    held = {m: store.claim_next(m, lease_s=30) for m in (c, a, b)}  # all three run
    for m, digest in ((c, "sha256:3"), (a, "sha256:1"), (b, "sha256:1")):
        replica = held[m]
        assert replica is not None and replica.replica_of == job.id
        store.finish(attempt(replica.id, 1, m), succeeded=True, exit_code=0, reason=None,
                     result="42", output_key=None, limits={}, output_digest=digest)
        # (c and a are to be compared; then b equals a)
    # a and b: a quorum; c, whose comparison never ended, is neither credited nor blamed.
    assert store.get(job.id).state is JobState.SUCCEEDED
    assert store.machines.get(c).status is Status.APPROVED and store.machines.get(c).agreed == 0
    other = submit(store, verify={"replicas": 2, "compare": "./cmp"})
    d, e = add_machine(store, "d"), add_machine(store, "e")
    run(store, d, digest="sha256:4")
    run(store, e, digest="sha256:5")
    for i in range(4):  # killed (exit 137) or failed by its machine, again and again
        claim = store.claim(add_machine(store, f"judge-{i}"), 30)
        assert claim is not None and claim.job.compare_pair is not None
        store.finish(attempt(claim.job.id, 1, claim.job.machine_id or ""), succeeded=False,
                     exit_code=137 if i % 2 else -1, reason="killed", result=None,
                     output_key=None, limits={})
    # Cannot be judged: not alike, so a third replica runs; no one is blamed.
    assert store.get(other.id).replicas == 3
    assert all(store.machines.get(m).status is Status.APPROVED for m in (d, e))


def test_replicas_the_compare_command_calls_unlike_bring_another_that_settles_it(store: Store):
    job = submit(store, verify={"replicas": 2, "compare": "./cmp"})
    m1, liar, m3 = (add_machine(store, n) for n in ("m1", "liar", "m3"))
    run(store, m1, digest="sha256:1")
    run(store, liar, digest="sha256:lie")
    compare(store, add_machine(store, "judge-0"), 1)  # unlike: a third replica runs
    assert store.get(job.id).replicas == 3
    run(store, m3, digest="sha256:3")
    # The third is compared with each of the others, by two judges where they are alike.
    for i in range(1, 6):
        if JobState(store.get(job.id).state).final:
            break
        judge = add_machine(store, f"judge-{i}")
        claim = store.claim(judge, 30)
        assert claim is not None and claim.job.compare_pair is not None
        said_by = {store.get(r).machine_id for r in claim.job.compare_pair}
        code = 1 if liar in said_by else 0
        store.finish(attempt(claim.job.id, 1, judge), succeeded=code == 0, exit_code=code,
                     reason=None, result=None, output_key=None, limits={})
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and done.machine_id in (m1, m3)
    assert store.machines.get(liar).status is Status.QUARANTINED
    assert all(j.state.final for j in store.list_jobs()) and len(store.list_jobs()) == 1


def test_cancelling_a_verified_job_cancels_its_replicas_and_a_replica_is_not_cancelled_alone(
        store: Store):
    job = submit(store, verify={"replicas": 2})
    m = add_machine(store, "m1")
    held = store.claim_next(m, lease_s=30)
    assert held is not None
    with pytest.raises(InvalidInput, match="cancel that job instead"):
        store.cancel(held.id)
    store.cancel(job.id)
    assert {r.state for r in store.replicas(job.id)} == {JobState.CANCELLED}
    assert store.get(job.id).state is JobState.CANCELLED


def test_adaptive_trusts_a_machine_only_after_agreeing_answers_in_a_row(
        store: Store, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(verified, "draw", lambda: 0.99)  # never sampled for a check
    new, trusted, other = (add_machine(store, n) for n in ("new", "trusted", "other"))
    with store.tx() as s:
        from campugrid.coordinator.models import Machine
        s.get(Machine, trusted).streak = 50
    job = submit(store, verify="adaptive")
    assert job.replicas == 1 and job.spec.image.reuse == "verified"
    run(store, trusted)
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and "alone" in store.events(job.id)[-1].detail
    job = submit(store, verify="adaptive")
    run(store, new)
    assert store.get(job.id).state is JobState.RUNNING and store.get(job.id).replicas == 2
    run(store, other)
    assert store.get(job.id).state is JobState.SUCCEEDED
    assert store.machines.get(new).streak == 1


# --- sharded jobs: each shard run as copies on different machines --------------------------


def work_through(store: Store, machine: str, answer=lambda i: i * 10) -> list[int]:
    """The machine opens a session and answers every shard it is given; the shards it got."""
    claim = store.claim(machine, 30)
    if claim is None or claim.session is None:
        return []
    ref, task, got = claim.hold(machine), claim.shard, []
    while task is not None:
        got.append(task.index)
        task = store.shards.next_shard(ref, ShardResult(task.index, True, 0,
                                                        json.dumps(answer(task.index)), None),
                                       heavy_first=True)
    return got


def test_each_shard_of_a_verified_sweep_is_decided_by_copies_on_different_machines(store: Store):
    job = submit(store, command=["python3", "w.py"], verify={"replicas": 2},
                 shards=[{"payload": {"i": i}} for i in range(3)])
    assert job.shards_total == 3 and job.shards_queued == 6 and job.replicas == 0
    m1, liar, m3 = (add_machine(store, n) for n in ("m1", "liar", "m3"))
    assert sorted(work_through(store, m1)) == [0, 1, 2]  # one copy of each, never two
    assert work_through(store, m1) == []  # nothing left that it may take
    assert sorted(work_through(store, liar, answer=lambda i: i * 10 + (i == 1))) == [0, 1, 2]
    # shards 0 and 2 agree; shard 1 disagrees and needs a third copy, which m3 runs
    assert store.get(job.id).state is not JobState.SUCCEEDED
    assert work_through(store, m3) == [1]
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED, done.reason
    listed = store.shards.shards(job.id)
    assert [(s.index, s.result) for s in listed] == [(0, 0), (1, 10), (2, 20)]
    assert sorted(listed[1].copies, key=str) == sorted([(m1, 10, True), (liar, 11, False),
                                                        (m3, 10, True)], key=str)
    record = store.machines.get(liar)
    assert record.status is Status.QUARANTINED and "shard 1" in record.quarantine
    assert store.machines.get(m1).agreed == 3 and store.machines.get(m3).agreed == 1
    # A sweep it ran alone before (unverified): its shards are marked on their job.
    assert not done.tainted


def test_a_machine_that_found_only_its_own_shards_copies_takes_a_copy_that_appears_later(
        store: Store):
    """It was not offered the sweep while every waiting copy was of a shard it answered; a
    copy of another shard that waits later is offered to it again (not an hour later)."""
    sweep = submit(store, verify="adaptive", command="x",
                   shards=[{"payload": 0}, {"payload": 1}])
    a, b = add_machine(store, "a"), add_machine(store, "b")
    first, second = store.claim(a, 30), store.claim(b, 30)
    assert first is not None and second is not None and first.shard and second.shard
    done = ShardResult(first.shard.index, True, 0, "0", None)
    assert store.shards.next_shard(first.hold(a), done, heavy_first=True) is None
    assert store.claim(a, 30) is None  # only its own shard's copy waits
    done = ShardResult(second.shard.index, True, 0, str(second.shard.index * 10), None)
    nxt = store.shards.next_shard(second.hold(b), done, heavy_first=True)
    assert nxt is not None and nxt.index == first.shard.index  # b checks a's shard
    again = store.claim(a, 30)  # and a, b's (a copy that waits now)
    assert again is not None and again.shard is not None
    assert again.shard.index == second.shard.index
    assert store.get(sweep.id).state is JobState.RUNNING


def test_the_shards_a_liar_answered_alone_are_marked_on_their_job(store: Store):
    liar, m2, m3 = (add_machine(store, n) for n in ("liar", "m2", "m3"))
    sweep = submit(store, command=["python3", "w.py"], shards=[{"payload": i} for i in range(3)])
    assert len(work_through(store, liar)) == 3
    job = submit(store, verify={"replicas": 2})
    run(store, m2)
    run(store, liar, result="41", digest=WRONG)
    run(store, m3)
    assert store.machines.get(liar).status is Status.QUARANTINED
    tainted = store.get(sweep.id).tainted
    assert tainted is not None and tainted.startswith("shard(s) 0, 1, 2 were answered by machine")
    assert store.get(job.id).tainted is None


def test_an_adaptive_sweep_copies_only_what_an_untrusted_machine_answered(
        store: Store, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(verified, "draw", lambda: 0.99)
    trusted, new, other = (add_machine(store, n) for n in ("trusted", "new", "other"))
    with store.tx() as s:
        from campugrid.coordinator.models import Machine
        s.get(Machine, trusted).streak = 100
    job = submit(store, command=["python3", "w.py"], verify="adaptive",
                 shards=[{"payload": {"i": i}} for i in range(4)])
    assert job.shards_queued == 4
    claim = store.claim(trusted, 30)
    assert claim is not None and claim.shard is not None
    store.shards.next_shard(claim.hold(trusted), ShardResult(claim.shard.index, True, 0, "7", None),
                            heavy_first=True)  # and takes the next
    got = work_through(store, new)
    assert len(got) == 2  # the two left; the trusted machine holds one
    assert store.get(job.id).shards_queued == 2  # each of the new machine's answers is checked
    assert sorted(work_through(store, other)) == sorted(got)
    assert store.get(job.id).shards_done == 3


# --- checkpoints: who made them, from what, and whether a job may resume from them ----------


def test_a_job_never_resumes_from_a_checkpoint_a_quarantined_machine_made(store: Store):
    job = submit(store)
    honest, liar, third = (add_machine(store, n) for n in ("honest", "liar", "third"))

    def attempt_on(machine: str, epochs: list[int]) -> int:
        held = store.claim_next(machine, lease_s=30)
        assert held is not None and held.id == job.id
        for e in epochs:
            store.checkpoints.record(attempt(job.id, held.attempt, machine), epoch=e,
                                    key=f"checkpoints/{job.id}/{held.attempt}-{e}", size=1,
                                    sha256="0" * 64, keep=10)
        store.release(attempt(job.id, held.attempt, machine), "drained", failed=False)
        return held.attempt

    attempt_on(honest, [1, 2])
    attempt_on(liar, [3, 4])
    by_epoch = {c.epoch: c for c in store.checkpoints.of(job.id)}
    assert (by_epoch[2].machine_id, by_epoch[2].resumed_from) == (honest, None)
    assert (by_epoch[4].machine_id, by_epoch[4].resumed_from) == (liar, 2)
    with store.tx() as s:
        verified.quarantine(s, liar, utcnow(), "it lied elsewhere")
    claim = store.claim(third, 30)
    assert claim is not None and claim.resume is not None and claim.resume.epoch == 2
    assert store.checkpoints.latest(job.id).epoch == 2


def test_a_replica_resumes_only_from_its_own_machines_checkpoints(store: Store):
    job = submit(store, verify={"replicas": 2})
    a, b = add_machine(store, "a"), add_machine(store, "b")
    first = store.claim_next(a, lease_s=30)
    assert first is not None and first.replica_of == job.id
    store.checkpoints.record(attempt(first.id, 1, a), epoch=5, key="checkpoints/x", size=1,
                            sha256="0" * 64, keep=3)
    store.release(attempt(first.id, 1, a), "drained", failed=False)
    taken = store.claim(b, 30)  # either replica: never from a's checkpoint
    assert taken is not None and taken.resume is None
    again = store.claim(a, 30)  # its own replica again, if b left it, from its own checkpoint
    if taken.job.id == first.id:
        assert again is None  # a never takes the other replica
    else:
        assert again is not None and again.job.id == first.id and again.resume.epoch == 5
