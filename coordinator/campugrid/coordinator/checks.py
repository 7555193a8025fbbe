"""Checkpoints checked by recomputation: one machine's checkpoint is not taken on its word.

A job that asks (spec.verify.checkpoints, or verify "adaptive" by the machine's record) has a
sampled fraction of its checkpoints recomputed: for checkpoint k, a *check* is queued, a plain
job of its own (check_of = k) that another machine runs from the checkpoint before k
(check_from; none: from the start) until it has saved k's epoch. The coordinator reads both
archives itself (content_digest, quorum.output_digest: files and bytes, not tar order or
times) and compares them as replicas are compared (quorum.decide, CHECK_RULE): the maker and
one check agree, or a third machine breaks the tie. A check ends as soon as it has answered
(its agent hears it at its next renewal, and stops the sandbox).

The losing side is quarantined (verified.judge). A rejected checkpoint is never resumed from,
nor is any made after it in its chain; the job, if it is running, goes back to the queue
(without costing an attempt) and resumes from the newest checkpoint that a check agreed with
or that a machine in good standing made (claims.RESUMABLE).

Every function here runs inside the caller's transaction (record_checkpoint, finish, the
reaper), which holds the checked job's row first (verified.lock_parent).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from campugrid.coordinator.models import Checkpoint, GpuReservation, Job, JobEvent, Machine
from campugrid.coordinator.moves import move_job
from campugrid.coordinator.quorum import Answer, checkpoint_probability, decide
from campugrid.coordinator.verified import draw, judge, kept_apart
from campugrid.coordinator.views import stored_spec
from campugrid.protocol.spec import Verify
from campugrid.protocol.states import JobState

# The maker's checkpoint and one check must agree; on a disagreement a third machine decides.
CHECK_RULE = Verify(replicas=2, quorum=2, max_replicas=3)
AGREED, REJECTED, DISPUTED = "agreed", "rejected", "disputed"


def group(checkpoint_id: int) -> str:
    """The name under which the machines of one checkpoint's checks are kept apart."""
    return f"ckpt-{checkpoint_id}"


def governing(s: Session, job: Job) -> Verify | None:
    """The verify that says whether this job's checkpoints are checked: its own, or for a
    replica its verified job's (a replica's spec has none); never a check's own."""
    if job.check_of is not None:
        return None
    text = (job.spec_json if job.replica_of is None else
            s.scalar(select(Job.spec_json).where(Job.id == job.replica_of)))
    return stored_spec(text or "{}").verify


def wants_digest(s: Session, job: Job) -> bool:
    """Must the coordinator read this job's checkpoints (a check's answer, or one that may be
    checked)?"""
    verify = governing(s, job)
    return job.check_of is not None or (
        verify is not None and (bool(verify.checkpoints) or verify.adaptive))


def recorded(s: Session, job: Job, ckpt: Checkpoint, now: dt.datetime,
             sample: float | None = None) -> None:
    """A checkpoint of `job` was just recorded: a check's answer is compared; any other is
    checked with the probability its verify asks (`sample`: the draw, for tests)."""
    if job.check_of is not None:
        _answered(s, job, ckpt, now)
        return
    verify = governing(s, job)
    if verify is None or ckpt.content_digest is None:
        return
    streak = s.scalar(select(Machine.streak).where(Machine.id == ckpt.machine_id)) or 0
    if (draw() if sample is None else sample) >= checkpoint_probability(verify, streak):
        return
    before = s.scalars(select(Checkpoint).where(
        Checkpoint.job_id == job.id, Checkpoint.id < ckpt.id, Checkpoint.epoch < ckpt.epoch,
        Checkpoint.verdict.is_distinct_from(REJECTED))
        .order_by(Checkpoint.epoch.desc(), Checkpoint.id.desc()).limit(1)).first()
    if ckpt.machine_id:  # its maker takes none of its checks (nor a machine at its address)
        kept_apart(s, group(ckpt.id), job.id, ckpt.machine_id)
    _make_check(s, job, ckpt, before.id if before is not None else None, now)


def _make_check(s: Session, job: Job, ckpt: Checkpoint, check_from: int | None,
                now: dt.datetime, queued_at: dt.datetime | None = None) -> Job:
    """A check of `ckpt`, queued now (or at `queued_at`: a tie-breaker keeps the place of the
    first check, ahead of the checks queued since, so that a disagreement is settled first)."""
    spec = stored_spec(job.spec_json).as_replica()
    row = Job(
        id=str(uuid.uuid4()), owner_id=job.owner_id, client_job_id=None,
        name=f"{job.name or 'job ' + job.id[:8]}: check of epoch {ckpt.epoch}",
        state=JobState.QUEUED.value, spec_json=spec.to_json(), context_key=job.context_key,
        context_sha256=job.context_sha256, attempt=0, max_attempts=job.max_attempts,
        gpus_needed=job.gpus_needed, limits_needed=job.limits_needed,
        cpus_needed=job.cpus_needed, memory_needed_mb=job.memory_needed_mb,
        disk_needed_mb=job.disk_needed_mb, share=job.share, shards_total=0, shards_queued=0,
        shards_done=0, shards_failed=0, bases_json=job.bases_json, apart=group(ckpt.id),
        check_of=ckpt.id, check_from=check_from, created_at=queued_at or now,
        updated_at=now)
    s.add(row)
    start = (f"from its checkpoint {check_from}" if check_from is not None
             else "from the start")
    _event(s, job.id, now, "check", f"the checkpoint of epoch {ckpt.epoch} (machine "
           f"{(ckpt.machine_id or '?')[:8]}) is recomputed by job {row.id}, {start}")
    return row


def _answered(s: Session, check: Job, ckpt: Checkpoint, now: dt.datetime) -> None:
    """The check saved a checkpoint: once it is the epoch it recomputes, that is its answer
    (the check ends: its agent hears so at its next renewal)."""
    target = s.get(Checkpoint, check.check_of)
    if target is None or JobState(check.state).final or ckpt.epoch < target.epoch:
        return
    if ckpt.epoch > target.epoch:
        _end(s, check, JobState.FAILED, now, reason=f"it saved epoch {ckpt.epoch} without "
             f"epoch {target.epoch}: nothing to compare")
    else:
        _end(s, check, JobState.SUCCEEDED, now, output_digest=ckpt.content_digest,
             exit_code=0, result=f"epoch {ckpt.epoch}: {ckpt.content_digest}")
    settle(s, target, now)


def _end(s: Session, check: Job, state: JobState, now: dt.datetime, **values: Any) -> None:
    move_job(s, check.id, state, lease_expires_at=None, updated_at=now, **values)
    s.execute(delete(GpuReservation).where(GpuReservation.job_id == check.id))
    s.add(JobEvent(job_id=check.id, at=now, attempt=check.attempt, kind=state.value,
                   detail=str(values.get("reason") or values.get("result") or "")[:4000]))


def settle(s: Session, target: Checkpoint, now: dt.datetime) -> None:
    """A check of `target` ended: compare every answer (the maker's first) and act."""
    if target.verdict is not None:
        return
    checks = list(s.scalars(select(Job).where(Job.check_of == target.id)
                            .order_by(Job.created_at, Job.updated_at, Job.id)))
    ended = [c for c in checks if JobState(c.state).final]
    maker = Answer(target.job_id, target.machine_id or "", (0, "", target.content_digest or ""))
    answers = [maker, *(Answer(c.id, c.machine_id or "", (0, "", c.output_digest)
                               if c.state == JobState.SUCCEEDED.value and c.output_digest
                               else None) for c in ended)]
    decision = decide(CHECK_RULE, answers, pending=len(checks) - len(ended),
                      made=1 + len(checks), streak={}, draw=1.0)
    job = s.get(Job, target.job_id, populate_existing=True)
    if job is None:
        return
    what = f"the checkpoint of epoch {target.epoch} of job {job.id}"
    if decision.more:
        first = checks[0] if checks else None
        _make_check(s, job, target, first.check_from if first else None, now,
                    queued_at=first.created_at if first else None)
    elif decision.fail:
        said = [a for a in answers if a.key is not None]
        if len({a.key for a in said}) < 2:  # the checks ended without answering: unchecked
            _event(s, job.id, now, "unchecked", f"{what} could not be checked: "
                   + "; ".join(f"job {c.id[:8]}: {c.reason or c.state}" for c in ended))
            return
        target.verdict = DISPUTED
        why = (f"checkpoints disagree: no two of {len(said)} machines computed the same "
               f"{what[4:]} ({'; '.join(f'machine {a.machine_id[:8]}: {a.key[2][:19]}' for a in said if a.key)}); "  # noqa: E501
               "a job whose epochs are not reproducible bit for bit cannot have its checkpoints "
               "checked")
        _event(s, job.id, now, "disputed", why)
        if not JobState(job.state).final:
            move_job(s, job.id, JobState.FAILED, machine_id=None, lease_expires_at=None,
                     reason=why, updated_at=now)
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == job.id))
    elif decision.accept:
        if maker in decision.accept:
            target.verdict = AGREED
            _event(s, job.id, now, "checked", f"{what[4:]} agreed with "
                   f"{len(decision.accept) - 1} recomputation(s) on other machines")
        else:
            _reject(s, job, target, now)
        judge(s, decision, now, what)
        for c in checks:
            if not JobState(c.state).final:
                _end(s, c, JobState.CANCELLED, now, machine_id=None,
                     reason=f"not needed: {what} was decided")


def _reject(s: Session, job: Job, target: Checkpoint, now: dt.datetime) -> None:
    """`target` lost its check: it and every checkpoint made after it from it (its attempt's
    later epochs, and attempts resumed from its epoch or later) are never resumed from; the
    job, if running, resumes from a good one; checks of those checkpoints are not needed."""
    bad = (Checkpoint.job_id == job.id) & ((Checkpoint.id == target.id) | (
        (Checkpoint.id > target.id) & ((Checkpoint.attempt == target.attempt)
                                       | (Checkpoint.resumed_from >= target.epoch))))
    ids = list(s.scalars(select(Checkpoint.id).where(bad)))
    s.execute(update(Checkpoint).where(Checkpoint.id.in_(ids)).values(verdict=REJECTED)
              .execution_options(synchronize_session=False))
    target.verdict = REJECTED
    _event(s, job.id, now, "rejected", f"the checkpoint of epoch {target.epoch} (machine "
           f"{(target.machine_id or '?')[:8]}) lost its check: it and {len(ids) - 1} made from "
           "it are never resumed from")
    for c in s.scalars(select(Job).where(or_(Job.check_of.in_(ids), Job.check_from.in_(ids)),
                                         Job.check_of != target.id)):
        if not JobState(c.state).final:
            _end(s, c, JobState.CANCELLED, now, machine_id=None,
                 reason="not needed: the checkpoint it checks was rejected")
    if JobState(job.state).active:  # its attempt may be building on the rejected chain
        move_job(s, job.id, JobState.QUEUED, machine_id=None, lease_expires_at=None,
                 drained=Job.drained + 1, updated_at=now,
                 reason="a checkpoint it resumed from or made was rejected: it resumes from "
                        "a checked one")
        s.execute(delete(GpuReservation).where(GpuReservation.job_id == job.id))


def protected(s: Session, job_id: str, only_checked: bool = False) -> set[int]:
    """Checkpoints of `job_id` that retention keeps whatever their age: those a check still
    needs (checked, or resumed from), and the newest one a check agreed with; with
    `only_checked`, just those a check is recomputing."""
    keep: set[int] = set() if only_checked else set(s.scalars(select(Checkpoint.id).where(
        Checkpoint.job_id == job_id, Checkpoint.verdict == AGREED)
        .order_by(Checkpoint.epoch.desc(), Checkpoint.id.desc()).limit(1)))
    mine = select(Checkpoint.id).where(Checkpoint.job_id == job_id).scalar_subquery()
    for of, frm in s.execute(select(Job.check_of, Job.check_from).where(
            Job.check_of.in_(mine), Job.state.in_([x.value for x in JobState if not x.final]))):
        if of is not None:
            keep.add(of)
        if frm is not None and not only_checked:
            keep.add(frm)
    return keep


def subject_of(s: Session, check_of: int) -> str | None:
    """The job whose checkpoint a check recomputes."""
    return s.scalar(select(Checkpoint.job_id).where(Checkpoint.id == check_of))


def _event(s: Session, job_id: str, now: dt.datetime, kind: str, detail: str) -> None:
    s.add(JobEvent(job_id=job_id, at=now, attempt=0, kind=kind, detail=detail[:4000]))
