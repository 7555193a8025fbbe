"""Checkpoints checked by recomputation, in the store, on SQLite and on a real PostgreSQL
(coordinator/checks.py): a check recomputes a checkpoint on another machine from the one
before; agreement marks it checked, a liar's checkpoint is outvoted, rejected with what was
made from it, its machine quarantined, and the job resumes from a checked one."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from campugrid.coordinator import verified
from campugrid.coordinator.machines import Status
from campugrid.coordinator.models import Checkpoint, Job
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import JobView, utcnow
from campugrid.protocol.errors import IllegalTransition, InvalidInput, StaleAttempt
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.holds import attempt
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


def digest(epoch: int, lie: bool = False) -> str:
    """What an honest machine's checkpoint of this epoch holds (the same on every machine)."""
    return f"sha256:{'bad' if lie else 'good'}-{epoch}"


def submit(store: Store, **spec: object) -> JobView:
    return store.submit(JobSpec.from_dict(dict(spec)), "contexts/x.tar", "ab" * 32)[0]


def save(store: Store, job: JobView, machine: str, epoch: int, *, lie: bool = False,
         keep: int = 10, sampled: bool = True, answer: str | None = None) -> list[str]:
    """The machine records a checkpoint of this epoch; `sampled`: the coordinator drew it for
    a check and read it (services/leasing.py does both), so it holds what `lie` says."""
    return store.checkpoints.record(attempt(job.id, job.attempt, machine), epoch=epoch,
                                   key=f"checkpoints/{job.id}/{job.attempt}-{epoch}-{machine}",
                                   size=1, sha256="0" * 64, keep=keep,
                                   content_digest=answer or digest(epoch, lie) if sampled
                                   else None)


def started(store: Store, *machines: str, **spec: object) -> tuple[JobView, JobView, list[str]]:
    """A job whose every checkpoint is drawn for a check, leased to the first of these new
    machines: (the job, its attempt, the machines)."""
    job = submit(store, **{"verify": {"checkpoints": 1}, **spec})
    ms = [add_machine(store, n) for n in machines]
    held = store.claim_next(ms[0], lease_s=30)
    assert held is not None and held.id == job.id
    return job, held, ms


def checks_of(store: Store, job_id: str) -> list[JobView]:
    """The checks of the job's checkpoints, oldest first."""
    with store.read() as s:
        ids = list(s.scalars(select(Job.id).where(Job.check_of.in_(
            select(Checkpoint.id).where(Checkpoint.job_id == job_id).scalar_subquery()))
            .order_by(Job.created_at, Job.id)))
    return [store.get(i) for i in ids]


def answer(store: Store, machine: str, *, lie: bool = False) -> tuple[JobView, int]:
    """The machine takes the next check it may and answers it: it saves the epoch it
    recomputes (honestly, or not). Returns the check and that epoch."""
    claim = store.claim(machine, 30)
    assert claim is not None, f"machine {machine} was given nothing"
    with store.read() as s:
        epoch = s.scalar(select(Checkpoint.epoch).where(Checkpoint.id == Job.check_of,
                                                        Job.id == claim.job.id))
    assert epoch is not None, "it was given a job, not a check"
    save(store, claim.job, machine, epoch, lie=lie)
    return claim.job, epoch


def verdicts(store: Store, job_id: str) -> dict[int, str | None]:
    return {c.epoch: c.verdict for c in store.checkpoints.of(job_id)}


def test_a_checkpoint_is_recomputed_elsewhere_from_the_one_before_and_agreed(store: Store):
    job = submit(store, verify={"checkpoints": 1})
    maker, checker = add_machine(store, "maker"), add_machine(store, "checker")
    assert job.replicas == 0 and store.checkpoints.probability(job.id, maker) == 1
    held = store.claim_next(maker, lease_s=30)
    assert held is not None and held.id == job.id  # checkpoints alone: the job runs once
    save(store, held, maker, 0)
    save(store, held, maker, 1)
    first, second = checks_of(store, job.id)
    assert [j.id for j in store.list_jobs()] == [job.id]  # checks show on their job only
    assert verdicts(store, job.id) == {0: "checking", 1: "checking"}
    assert store.claim(maker, 30) is None  # its maker checks none of its checkpoints
    claim = store.claim(checker, 30)
    assert claim is not None and claim.job.id == first.id and claim.resume is None  # epoch 0
    assert claim.job.spec.verify is None  # a check is never checked; its answer always read
    assert store.checkpoints.probability(first.id, checker) == 1
    save(store, claim.job, checker, 0)
    assert store.get(first.id).state is JobState.SUCCEEDED  # it answered: it ends
    with pytest.raises((StaleAttempt, IllegalTransition)):  # its agent hears so, and stops
        store.renew_lease(attempt(first.id, claim.job.attempt, checker), JobState.RUNNING, 30)
    claim = store.claim(checker, 30)
    assert claim is not None and claim.job.id == second.id
    assert claim.resume is not None and claim.resume.epoch == 0  # from the one before
    save(store, claim.job, checker, 1)
    assert verdicts(store, job.id) == {0: "agreed", 1: "agreed"}
    assert [c.resumed_from for c in store.checkpoints.of(second.id)] == [0]
    for m in (maker, checker):  # agreements, but no adaptive trust: checks are cheap to pass
        record = store.machines.get(m)
        assert (record.agreed, record.streak) == (2, 0)
    kinds = [e.kind for e in store.events(job.id)]
    assert kinds.count("check") == 2 and kinds.count("checked") == 2
    assert store.get(job.id).state is JobState.BUILDING  # the job itself ran on


def test_a_poisoned_checkpoint_is_outvoted_and_the_job_resumes_from_a_checked_one(
        store: Store):
    job, held, (liar, a, b) = started(store, "liar", "a", "b")
    save(store, held, liar, 0)
    save(store, held, liar, 1, lie=True)
    assert [answer(store, a)[1] for _ in range(2)] == [0, 1]
    assert verdicts(store, job.id) == {0: "agreed", 1: "checking"}  # a disagreed with it
    save(store, held, liar, 2, lie=True)  # made from its lie, and checked in turn
    seen = []
    while verdicts(store, job.id)[1] == "checking":
        seen.append(answer(store, b)[1])
    assert 1 in seen
    assert verdicts(store, job.id) == {0: "agreed", 1: "rejected", 2: "rejected"}
    record = store.machines.get(liar)
    assert record.status is Status.QUARANTINED and "epoch 1" in record.quarantine
    assert store.machines.get(a).status is Status.APPROVED
    assert store.machines.get(b).status is Status.APPROVED
    assert store.machines.get(b).agreed == 1
    # The job went back to the queue at once, without costing an attempt, and every check
    # of what the liar made from its lie is called off.
    again = store.get(job.id)
    assert again.state is JobState.QUEUED and "rejected" in (again.reason or "")
    assert all(c.state.final for c in checks_of(store, job.id))
    resumed = store.claim(a, 30)
    assert resumed is not None and resumed.job.id == job.id and resumed.resume.epoch == 0
    assert store.checkpoints.latest(job.id).epoch == 0


def test_a_check_that_lies_is_the_one_quarantined(store: Store):
    job, held, (maker, liar, third) = started(store, "maker", "liar", "third")
    save(store, held, maker, 0)
    answer(store, liar, lie=True)
    answer(store, third)
    assert verdicts(store, job.id) == {0: "agreed"}
    assert store.machines.get(liar).status is Status.QUARANTINED
    assert store.machines.get(maker).status is Status.APPROVED
    assert store.get(job.id).state is JobState.BUILDING  # the job's own attempt goes on


def test_checkpoints_that_no_two_machines_compute_alike_fail_the_job(store: Store):
    job = submit(store, verify={"checkpoints": 1})
    ms = [add_machine(store, f"m{i}") for i in range(3)]
    held = store.claim_next(ms[0], lease_s=30)
    assert held is not None
    store.checkpoints.record(attempt(job.id, 1, ms[0]), epoch=0, key="k0", size=1,
                            sha256="0" * 64, keep=5, content_digest="sha256:0")
    for i in (1, 2):
        claim = store.claim(ms[i], 30)
        assert claim is not None
        store.checkpoints.record(attempt(claim.job.id, claim.job.attempt, ms[i]), epoch=0,
                                key=f"k{i}", size=1, sha256="0" * 64, keep=5,
                                content_digest=f"sha256:{i}")
    done = store.get(job.id)
    assert done.state is JobState.FAILED and "checkpoints disagree" in (done.reason or "")
    assert verdicts(store, job.id) == {0: "disputed"}
    assert all(store.machines.get(m).status is Status.APPROVED for m in ms)  # no one blamed


def test_a_check_that_ends_without_answering_is_replaced(store: Store):
    job, held, (maker, a, b) = started(store, "maker", "a", "b", max_attempts=1)
    save(store, held, maker, 0)
    claim = store.claim(a, 30)
    assert claim is not None
    store.finish(attempt(claim.job.id, 1, a), succeeded=False, exit_code=1, reason="crashed",
                 result=None, output_key=None, limits={})
    assert len(checks_of(store, job.id)) == 2  # another machine tries
    answer(store, b)
    assert verdicts(store, job.id) == {0: "agreed"}


def test_retention_keeps_what_a_check_needs_and_the_newest_checked_one(store: Store):
    job = submit(store, verify={"checkpoints": 1})
    maker, checker = add_machine(store, "maker"), add_machine(store, "checker")
    held = store.claim_next(maker, lease_s=30)
    assert held is not None
    save(store, held, maker, 0, keep=1)
    answer(store, checker)  # epoch 0 is checked
    dropped = []
    for e in (1, 2, 3):
        dropped += save(store, held, maker, e, keep=1)
    # 0 is the newest checked one; 1..3 wait for their checks (and each starts from the one
    # before): nothing is dropped.
    assert verdicts(store, job.id) == {0: "agreed", 1: "checking", 2: "checking",
                                       3: "checking"} and dropped == []
    assert sorted(answer(store, checker)[1] for _ in range(3)) == [1, 2, 3]
    dropped = save(store, held, maker, 4, keep=1)  # 3 is checked now: the older ones go
    assert {c.epoch for c in store.checkpoints.of(job.id)} == {3, 4}
    assert len(dropped) == 3


def test_without_a_fraction_nothing_is_checked_or_read(store: Store):
    plain, off = submit(store), submit(store, verify={"checkpoints": 0, "replicas": 2})
    m = add_machine(store, "m")
    assert store.checkpoints.probability(plain.id, m) == 0
    assert store.checkpoints.probability(off.id, m) == 0
    adaptive = submit(store, verify="adaptive")  # by the machine's record: untrusted, always
    replica = store.replicas(adaptive.id)[0]
    assert store.checkpoints.probability(replica.id, m) == 1
    held = store.claim_next(m, lease_s=30)
    assert held is not None and held.id == plain.id
    save(store, held, m, 0)  # even if read, a job that asks nothing is not checked
    assert checks_of(store, plain.id) == [] and verdicts(store, plain.id) == {0: None}


def test_a_check_resumes_from_what_the_checkpoint_was_made_from(store: Store):
    """Not from another attempt's checkpoint of an earlier epoch: an honest machine that
    started over is checked against its own chain, never a liar's."""
    job, held, (liar, honest, a, b) = started(store, "liar", "honest", "a", "b")
    save(store, held, liar, 1, lie=True, sampled=False)  # not drawn: no check
    store.release(attempt(job.id, held.attempt, liar), "drained", failed=False)
    with store.tx() as s:  # the liar's epoch 1 is set aside some other way (an admin)
        s.execute(update(Checkpoint).where(Checkpoint.job_id == job.id)
                  .values(verdict="untrusted"))
    again = store.claim(honest, 30)
    assert again is not None and again.job.id == job.id and again.resume is None
    save(store, again.job, honest, 2)
    claim = store.claim(a, 30)
    assert claim is not None and claim.resume is None  # from the start, as its maker did
    save(store, claim.job, a, 2)
    assert verdicts(store, job.id)[2] == "agreed"
    assert store.machines.get(honest).status is Status.APPROVED
    assert store.claim(b, 30) is None


def test_an_agreed_step_from_a_quarantined_machines_checkpoint_is_not_resumed_from(
        store: Store):
    job, held, (liar, a, b) = started(store, "liar", "a", "b")
    save(store, held, liar, 1, lie=True, sampled=False)  # not drawn
    save(store, held, liar, 2)  # drawn: an honest step, from its own poisoned epoch 1
    assert answer(store, a)[1] == 2 and verdicts(store, job.id) == {1: None, 2: "agreed"}
    store.release(attempt(job.id, held.attempt, liar), "drained", failed=False)
    with store.tx() as s:  # caught elsewhere
        verified.quarantine(s, liar, utcnow(), "it lied elsewhere")
    assert verdicts(store, job.id) == {1: "untrusted", 2: "untrusted"}
    claim = store.claim(b, 30)
    assert claim is not None and claim.job.id == job.id and claim.resume is None


def test_a_job_that_ended_from_a_rejected_checkpoint_is_tainted(store: Store):
    job, held, (liar, h, a, b) = started(store, "liar", "h", "a", "b")
    save(store, held, liar, 1, lie=True)
    store.release(attempt(job.id, held.attempt, liar), "drained", failed=False)
    resumed = store.claim(h, 30)  # before the check: from the liar's epoch 1
    assert resumed is not None and resumed.job.id == job.id and resumed.resume.epoch == 1
    answer(store, a)  # it disagrees with the liar: a tie-breaker is queued
    store.finish(attempt(job.id, resumed.job.attempt, h), succeeded=True, exit_code=0,
                 reason=None, result="done", output_key=None, limits={})
    assert not store.get(job.id).tainted
    answer(store, b)  # a disagreement is settled even after the job ended
    done = store.get(job.id)
    assert done.state is JobState.SUCCEEDED and "rejected" in (done.tainted or "")
    assert store.machines.get(liar).status is Status.QUARANTINED


def test_a_checkpoint_no_recomputation_can_reach_is_unverifiable_and_not_resumed_from(
        store: Store):
    """A liar's made-up epoch between the job's own (or an honest drain's off its cadence):
    the check saves the next epoch instead; no one is blamed, and no one resumes from it."""
    job = submit(store, verify={"checkpoints": 1})
    maker, a = add_machine(store, "maker"), add_machine(store, "a")
    held = store.claim_next(maker, lease_s=30)
    assert held is not None
    save(store, held, maker, 2, sampled=False)
    save(store, held, maker, 3)  # the job saves even epochs only
    claim = store.claim(a, 30)
    assert claim is not None and claim.resume.epoch == 2
    save(store, claim.job, a, 4)
    assert store.get(claim.job.id).state is JobState.FAILED
    assert verdicts(store, job.id) == {2: None, 3: "unverifiable"}
    assert len(checks_of(store, job.id)) == 1  # another check would skip it too
    assert store.machines.get(maker).status is Status.APPROVED
    # Its attempt made it: the job went back to the queue, and resumes from a good one.
    assert store.get(job.id).state is JobState.QUEUED
    again = store.claim(a, 30)
    assert again is not None and again.resume.epoch == 2


def test_a_tie_breaker_that_ends_without_answering_is_replaced_not_a_failure(store: Store):
    job, held, (maker, liar, flaky, d) = started(store, "maker", "liar", "flaky", "d")
    save(store, held, maker, 0)
    answer(store, liar, lie=True)
    claim = store.claim(flaky, 30)
    assert claim is not None
    store.finish(attempt(claim.job.id, 1, flaky), succeeded=False, exit_code=-1,
                 reason="the sandbox could not start", result=None, output_key=None, limits={})
    assert store.get(job.id).state is JobState.BUILDING
    answer(store, d)
    assert verdicts(store, job.id) == {0: "agreed"}
    assert store.machines.get(liar).status is Status.QUARANTINED


def test_a_replica_failed_by_disputed_checkpoints_lets_its_verified_job_decide(store: Store):
    job = submit(store, verify={"replicas": 2, "checkpoints": 1})
    ms = [add_machine(store, f"m{i}") for i in range(4)]
    first = store.claim_next(ms[0], lease_s=30)
    second = store.claim_next(ms[1], lease_s=30)
    assert first is not None and second is not None
    store.finish(attempt(second.id, 1, ms[1]), succeeded=True, exit_code=0, reason=None,
                 result="42", output_key=None, limits={}, output_digest="sha256:o")
    save(store, first, ms[0], 0, answer="sha256:0")
    for i in (2, 3):
        claim = store.claim(ms[i], 30)
        assert claim is not None and "check of epoch 0" in (claim.job.name or "")
        save(store, claim.job, ms[i], 0, answer=f"sha256:{i}")
    assert store.get(first.id).state is JobState.FAILED
    parent = store.get(job.id)
    assert parent.replicas == 3 and parent.state is JobState.RUNNING  # a third replica runs


def test_queued_checks_of_a_job_that_ended_are_cancelled_but_not_tie_breakers(store: Store):
    job = submit(store, verify={"checkpoints": 1})
    maker = add_machine(store, "maker")
    held = store.claim_next(maker, lease_s=30)
    assert held is not None
    save(store, held, maker, 0)
    store.finish(attempt(job.id, held.attempt, maker), succeeded=True, exit_code=0,
                 reason=None, result="done", output_key=None, limits={})
    assert [c.state for c in checks_of(store, job.id)] == [JobState.CANCELLED]


def test_cancelling_a_job_cancels_its_checks_and_a_check_is_not_cancelled_alone(store: Store):
    job = submit(store, verify={"checkpoints": 1})
    maker = add_machine(store, "maker")
    held = store.claim_next(maker, lease_s=30)
    assert held is not None
    save(store, held, maker, 0)
    (check,) = checks_of(store, job.id)
    with pytest.raises(InvalidInput, match="cancel that job instead"):
        store.cancel(check.id)
    with pytest.raises(InvalidInput, match="run that job again instead"):
        store.rerun(check.id)
    store.cancel(job.id)
    assert store.get(check.id).state is JobState.CANCELLED


def test_a_compare_command_judges_checkpoints_that_differ_bit_for_bit(store: Store):
    """Honest recomputations that differ (floating point): the job's compare command, on a
    machine that made neither, says whether they agree; unlike ones bring a tie-breaker."""
    job, held, (maker, checker, judge, third, judge2) = started(
        store, "maker", "checker", "judge", "third", "judge-2", verify={"checkpoints": 1,
                                                                    "compare": "./cmp"})
    save(store, held, maker, 0, answer="sha256:maker")
    answer(store, checker, lie=True)  # another digest: not equal, perhaps alike
    assert verdicts(store, job.id) == {0: "checking"}
    assert store.claim(maker, 30) is None and store.claim(checker, 30) is None
    claim = store.claim(judge, 30)
    assert claim is not None and claim.job.compare_pair is not None
    assert all(p.startswith("ckpt:") for p in claim.job.compare_pair)
    assert claim.job.spec.command == ("sh", "-c", "./cmp")
    store.finish(attempt(claim.job.id, 1, judge), succeeded=False, exit_code=1, reason=None,
                 result=None, output_key=None, limits={})  # unlike: a third machine recomputes
    answer(store, third)  # its digest differs from both too
    said = []
    judges = iter([judge2, *(add_machine(store, f"judge-{i}") for i in range(3, 8))])
    while (claim := store.claim(next(judges), 30)) is not None:  # each pair with the third
        pair = claim.job.compare_pair or ()
        with store.read() as s:
            makers = {s.scalar(select(Checkpoint.machine_id).where(
                Checkpoint.id == int(p[5:]))) for p in pair}
        code = 1 if checker in makers else 0  # the maker and the third are alike
        said.append(code)
        store.finish(attempt(claim.job.id, 1, claim.job.machine_id or ""),
                     succeeded=code == 0, exit_code=code, reason=None, result=None,
                     output_key=None, limits={})
        if verdicts(store, job.id)[0] != "checking":
            break
    assert verdicts(store, job.id) == {0: "agreed"}
    assert store.machines.get(checker).status is Status.QUARANTINED
    assert store.machines.get(maker).status is Status.APPROVED


def test_a_compare_command_outvotes_a_maker_whose_checkpoint_is_unlike_both_recomputations(
        store: Store):
    job, held, (liar, c1, c2) = started(store, "liar", "c1", "c2",
                                        verify={"checkpoints": 1, "compare": "./cmp"})
    save(store, held, liar, 0, answer="sha256:poisoned")
    answer(store, c1)
    makers: dict[str, str] = {}

    def judge_next() -> bool:
        claim = store.claim(add_machine(store, f"judge-{len(makers)}"), 30)
        if claim is None:
            return False
        with store.read() as s:
            pair = {s.scalar(select(Checkpoint.machine_id).where(Checkpoint.id == int(p[5:])))
                    for p in claim.job.compare_pair or ()}
        makers[claim.job.id] = ",".join(sorted(pair))
        code = 1 if liar in pair else 0  # the two honest recomputations are alike
        store.finish(attempt(claim.job.id, 1, claim.job.machine_id or ""), succeeded=code == 0,
                     exit_code=code, reason=None, result=None, output_key=None, limits={})
        return True

    assert judge_next()  # the liar and c1: unlike, so c2 recomputes it
    answer(store, c2)
    while verdicts(store, job.id)[0] == "checking" and judge_next():
        pass
    assert verdicts(store, job.id) == {0: "rejected"}, makers
    assert store.machines.get(liar).status is Status.QUARANTINED
