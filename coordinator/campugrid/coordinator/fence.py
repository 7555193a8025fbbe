"""The fence: whether a machine still holds what a call about held work names (a `HoldRef`,
views.py), written once per kind of hold; the stores' operations and the image steps use it,
and holds.py offers the verbs built on it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from campugrid.coordinator.models import Job, JobEvent, ShardSession
from campugrid.coordinator.views import HoldKind, HoldRef, utcnow
from campugrid.protocol.errors import IllegalTransition, StaleAttempt
from campugrid.protocol.states import ACTIVE, JobState


def attempt_guard(ref: HoldRef) -> list[Any]:
    """The guard of an attempt's guarded writes (moves.move_job's `where`): the attempt is
    the job's current one, on this machine (the move itself checks the state)."""
    return [Job.attempt == ref.token, Job.machine_id == ref.machine_id]


def attempt_held(row: Job, ref: HoldRef) -> bool:
    """The same fence on a job row read in the call's transaction, with its state."""
    return (row.attempt == ref.token and row.machine_id == ref.machine_id
            and JobState(row.state) in ACTIVE)


def session_row(s: Session, ref: HoldRef, what: str, *, ended_ok: bool = False) -> ShardSession:
    """The session `ref` names, held by this machine and active (`ended_ok`: or ended), else
    StaleAttempt."""
    row = s.get(ShardSession, ref.token, populate_existing=True)
    if row is None or row.job_id != ref.job_id or row.machine_id != ref.machine_id:
        raise StaleAttempt(f"{what}: no session {ref.token} of job {ref.job_id} on this machine")
    if not row.active and not ended_ok:
        job_state = s.scalar(select(Job.state).where(Job.id == ref.job_id))
        raise StaleAttempt(f"{what} from session {row.id} refused: the session is over "
                           f"(job {job_state})")
    return row


def live(s: Session, ref: HoldRef) -> bool:
    """Whether the hold is still this machine's, read in the caller's transaction."""
    if ref.kind is HoldKind.SESSION:
        try:
            session_row(s, ref, "")
        except StaleAttempt:
            return False
        return True
    job = s.get(Job, ref.job_id, populate_existing=True)
    return job is not None and attempt_held(job, ref)


def refusal(s: Session, row: Job, token: int, what: str,
            record: bool = True) -> StaleAttempt | IllegalTransition:
    """Record a refused call in the job's history (unless not `record`); the caller raises
    after committing."""
    if row.attempt != token:
        detail = f"{what} from attempt {token} refused: the current attempt is {row.attempt}"
    else:
        detail = f"{what} from attempt {token} refused: the job is {row.state}"
    if record:
        s.add(JobEvent(job_id=row.id, at=utcnow(), attempt=token, kind="refused",
                       detail=detail))
    return StaleAttempt(detail) if row.attempt != token else IllegalTransition(detail)
