"""Checkpoints checked by recomputation: one machine's checkpoint is not taken on its word.

A job that asks (spec.verify.checkpoints, or verify "adaptive" by the machine's record) has a
sampled fraction of its checkpoints recomputed. The sample is drawn when the checkpoint is
recorded (`probability`; the caller reads the archive only then). For a sampled checkpoint k
a *check* is queued: a plain job of its own (check_of = k) that another machine runs from the
checkpoint k was computed from (check_from = k's parent: its attempt's previous one, or the
one its attempt resumed from; none: the start) until it has saved k's epoch. The coordinator
reads both archives itself (content_digest, quorum.checkpoint_digest: files and bytes, not
tar order or times). The maker and a check agree: k is agreed. They differ: a third machine
recomputes it (queued first); the answer two machines share wins, and the odd machine is
quarantined (verified.judge). A check ends as soon as it has answered (its agent hears so at
its next renewal, and stops the sandbox).

A checkpoint that loses, and every one made from it, is rejected (verified.distrust): never
resumed from; a job computing from them goes back to the queue without costing an attempt
and resumes from the newest good checkpoint (claims.RESUMABLE); one that ended from them is
marked tainted. A sampled checkpoint that no check can recompute (its checks end without
saving its epoch) is unverifiable, and not resumed from either; no machine is blamed.

Every function here runs inside the caller's transaction (record_checkpoint, finish, the
reaper), which holds the checked job's row first (verified.lock_parent).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from campugrid.coordinator import verified
from campugrid.coordinator.models import Checkpoint, GpuReservation, Job, JobEvent, Machine
from campugrid.coordinator.moves import move_job
from campugrid.coordinator.quorum import (
    Answer,
    Decision,
    against,
    alike_group,
    checkpoint_probability,
    unjudged,
)
from campugrid.coordinator.verified import AGREED, DISPUTED, REJECTED, UNVERIFIABLE
from campugrid.coordinator.views import stored_spec
from campugrid.protocol.states import JobState
from campugrid.protocol.verify import Verify

MAX_CHECKS = 4  # checks of one checkpoint in all (those that end without answering included)
# A check's output_digest when it saved a later epoch without the one it recomputes: an honest
# run never saves that epoch (a drain's checkpoint, off the job's cadence), so no check can.
SKIPPED = "skipped"


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


def probability(s: Session, job: Job, machine_id: str) -> float:
    """How likely a checkpoint this machine just made for `job` is checked: 1 for a check's
    own (its answer is read, always), else as its verify asks."""
    if job.check_of is not None:
        return 1.0
    verify = governing(s, job)
    if verify is None:
        return 0.0
    streak = s.scalar(select(Machine.streak).where(Machine.id == machine_id)) or 0
    return checkpoint_probability(verify, streak)


def recorded(s: Session, job: Job, ckpt: Checkpoint, now: dt.datetime) -> None:
    """A checkpoint of `job` was just recorded, read by the coordinator where sampled
    (content_digest): a check's answer is compared; a sampled one is sent for a check."""
    if job.check_of is not None:
        _answered(s, job, ckpt, now)
    elif ckpt.content_digest is not None and governing(s, job) is not None:
        if ckpt.machine_id:  # its maker takes none of its checks (nor a machine of its party)
            verified.kept_apart(s, group(ckpt.id), job.id, ckpt.machine_id)
        _make_check(s, job, ckpt, now)


def _make_check(s: Session, job: Job, ckpt: Checkpoint, now: dt.datetime,
                queued_at: dt.datetime | None = None) -> Job:
    """A check of `ckpt`, queued now (or at `queued_at`: a tie-breaker keeps the place of the
    first check, ahead of the checks queued since, so that a disagreement is settled first)."""
    spec = stored_spec(job.spec_json).as_replica()
    row = verified.work_of(job, spec.to_json(), f"check of epoch {ckpt.epoch}", now,
                           apart=group(ckpt.id), check_of=ckpt.id, check_from=ckpt.parent_id,
                           created_at=queued_at or now)
    s.add(row)
    start = (f"from its checkpoint {ckpt.parent_id}" if ckpt.parent_id is not None
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
        _end(s, check, JobState.FAILED, now, output_digest=SKIPPED, reason=f"it saved epoch "
             f"{ckpt.epoch} without epoch {target.epoch}: nothing to compare")
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
    """A check of `target` ended: compare the answers (the maker's first) and act. Two equal
    answers decide; a check that ended without one is replaced, up to MAX_CHECKS."""
    if target.verdict is not None:
        return
    checks = list(s.scalars(select(Job).where(Job.check_of == target.id)
                            .order_by(Job.created_at, Job.updated_at, Job.id)))
    ended = [c for c in checks if JobState(c.state).final]
    job = s.get(Job, target.job_id, populate_existing=True)
    if job is None or job.check_of is not None:  # a check's own checkpoints are not checked
        return
    # Each answer by the checkpoint that gave it ("ckpt:<id>": what a comparison names).
    maker = Answer(f"ckpt:{target.id}", target.machine_id or "",
                   (0, "", target.content_digest or ""))
    answers = [maker]
    for c in ended:
        if c.state == JobState.SUCCEEDED.value and c.output_digest not in (None, SKIPPED):
            mine = s.scalar(select(Checkpoint.id).where(
                Checkpoint.job_id == c.id, Checkpoint.epoch == target.epoch)
                .order_by(Checkpoint.id.desc()).limit(1))
            answers.append(Answer(f"ckpt:{mine}", c.machine_id or "", (0, "", c.output_digest)))
    skipped = any(c.output_digest == SKIPPED for c in ended)
    verify = governing(s, job)
    command = verify.compare if verify is not None else None
    named = {a.replica for a in answers}  # this checkpoint's answers' comparisons
    compares = [c for c in s.scalars(select(Job).where(Job.compare_of == job.id))
                if set((c.compare_pair or "").split(",")) <= named] if command else []
    verdicts = verified.verdicts_of(compares) if command else None
    if verdicts:
        verified.cancel_judged(s, compares, verdicts, now)
    best = alike_group(answers, verdicts)
    what = f"the checkpoint of epoch {target.epoch} of job {job.id}"
    if command and verdicts is not None:
        # The job's compare command judges what equality cannot, before anything is decided:
        # and about the maker above all (a quorum without it says nothing of its checkpoint).
        pairs = unjudged(answers, verdicts)
        undecided = len(best) < 2 or (maker not in best
                                      and maker not in against(answers, best, verdicts))
        if undecided and pairs:
            for a, b in pairs:
                for _ in range(verified.judges_wanted(compares, (a, b))):
                    verified.make_compare(s, job, command, (a, b), ("", ""), group(target.id),
                                          now)
            return
    if len(best) >= 2:
        decision = Decision(accept=tuple(best), against=against(answers, best, verdicts))
        if maker in decision.accept:
            target.verdict = AGREED
            _event(s, job.id, now, "checked", f"{what[4:]} agreed with {len(best) - 1} "
                   "recomputation(s) on other machines")
        else:
            marked = verified.distrust(s, {target.id}, REJECTED, now,
                                       f"{what} lost its check")
            _event(s, job.id, now, "rejected", f"{what[4:]} (machine "
                   f"{(target.machine_id or '?')[:8]}) lost its check: it and {len(marked) - 1} "
                   "made from it are never resumed from")
            _cancel(s, select(Job).where(Job.check_of.in_(sorted(marked - {target.id}))), now,
                    "the checkpoint it checks was rejected")
        verified.judge(s, decision, now, what, trust=False)
        _cancel(s, select(Job).where(Job.check_of == target.id), now, f"{what} was decided")
    elif len(ended) < len(checks):
        return  # a check still runs
    elif len(answers) >= 3:  # three machines, three answers
        target.verdict = DISPUTED
        why = (f"checkpoints disagree: no two of {len(answers)} machines computed the same "
               f"{what[4:]} ("
               + "; ".join(f"machine {a.machine_id[:8]}: {(a.key or ('', '', ''))[2][:19]}"
                           for a in answers)
               + "); a job whose epochs are not reproducible bit for bit cannot have its "
                 "checkpoints checked")
        _event(s, job.id, now, "disputed", why)
        if not JobState(job.state).final:
            move_job(s, job.id, JobState.FAILED, machine_id=None, lease_expires_at=None,
                     reason=why, updated_at=now)
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == job.id))
            verified.cancel_queued_checks(s, job.id, now)
            if job.replica_of is not None:  # its verified job may be decided now
                verified.settle(s, job.replica_of, now)
    elif len(checks) < MAX_CHECKS and not skipped:
        first = checks[0] if checks else None
        _make_check(s, job, target, now, queued_at=first.created_at if first else None)
    else:
        marked = verified.distrust(s, {target.id}, UNVERIFIABLE, now,
                                   f"no check could recompute {what}")
        _event(s, job.id, now, "unverifiable", f"{what[4:]} could not be checked ("
               + "; ".join(f"job {c.id[:8]}: {c.reason or c.state}" for c in ended)
               + f"): it and {len(marked) - 1} made from it are not resumed from")


def _cancel(s: Session, query: Any, now: dt.datetime, why: str) -> None:
    for c in s.scalars(query):
        if not JobState(c.state).final:
            _end(s, c, JobState.CANCELLED, now, machine_id=None, reason=f"not needed: {why}")


def protected(s: Session, job_id: str, only_checked: bool = False) -> set[int]:
    """Checkpoints of `job_id` that retention keeps whatever their age: those a check still
    needs (checked, or resumed from), and the newest one a check agreed with; with
    `only_checked`, just those a check is recomputing."""
    keep: set[int] = set() if only_checked else set(s.scalars(select(Checkpoint.id).where(
        Checkpoint.job_id == job_id, Checkpoint.verdict == AGREED)
        .order_by(Checkpoint.epoch.desc(), Checkpoint.id.desc()).limit(1)))
    mine = select(Checkpoint.id).where(Checkpoint.job_id == job_id).scalar_subquery()
    for (pair,) in s.execute(select(Job.compare_pair).where(  # what a comparison reads
            Job.compare_of == job_id, Job.state.in_([x.value for x in JobState if not x.final]))):
        keep |= {int(p[5:]) for p in (pair or "").split(",") if p.startswith("ckpt:")}
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
