"""Epoch checkpoints in the database: each recorded (with what it was computed from, and its
check: checks.py), kept or dropped by retention, and the one a job resumes from."""

from __future__ import annotations

import dataclasses

from sqlalchemy import select

from campugrid.coordinator import checks, verified
from campugrid.coordinator.claims import RESUMABLE
from campugrid.coordinator.db import Database, job_row
from campugrid.coordinator.fence import attempt_held, refusal
from campugrid.coordinator.models import Checkpoint, JobEvent
from campugrid.coordinator.views import CheckpointView, HoldRef, utcnow


class CheckpointRecords:
    """The checkpoint operations; each is one transaction of the job store."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, ref: HoldRef, *, epoch: int, key: str, size: int, sha256: str,
                          keep: int, content_digest: str | None = None,
                          label: str = "") -> list[str]:
        """Record a verified checkpoint of the current attempt (with its `content_digest` as
        the coordinator read it where it was sampled: `probability`); a check's answer
        is compared, a sampled checkpoint is sent for a check (checks.recorded). Return the
        keys that retention (the newest `keep` good ones per job, and those checks need)
        dropped, for the caller to delete from storage."""
        job_id, token = ref.job_id, ref.token
        with self.db.tx() as s:
            verified.lock_parent(s, job_id)
            row = job_row(s, job_id)
            if not attempt_held(row, ref):
                refused = refusal(s, row, token, f"checkpoint of epoch {epoch}")
            else:
                refused = None
                now = utcnow()
                # What it was computed from: its attempt's previous checkpoint, or the one its
                # attempt resumed from (its lease's: Job.resume_id); and that one's epoch.
                prev = s.scalars(select(Checkpoint).where(
                    Checkpoint.job_id == job_id, Checkpoint.attempt == token)
                    .order_by(Checkpoint.id.desc()).limit(1)).first()
                parent = prev.id if prev is not None else row.resume_id
                resumed_from = (prev.resumed_from if prev is not None else
                                s.scalar(select(Checkpoint.epoch).where(
                                    Checkpoint.id == row.resume_id))
                                if row.resume_id is not None else None)
                ckpt = Checkpoint(job_id=job_id, attempt=token, epoch=epoch, key=key, size=size,
                                  sha256=sha256, created_at=now, machine_id=ref.machine_id,
                                  resumed_from=resumed_from, content_digest=content_digest,
                                  parent_id=parent, label=label or None)
                s.add(ckpt)
                s.add(JobEvent(job_id=job_id, at=now, attempt=token, kind="checkpoint",
                               detail=f"epoch {epoch}, {size} bytes"
                                      + (f" ({label})" if label else "")))
                s.flush()
                checks.recorded(s, row, ckpt, now)
                s.flush()
                rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                                      .order_by(Checkpoint.epoch.desc(), Checkpoint.id.desc())))
                needed = checks.protected(s, job_id)
                good = [r for r in rows if r.verdict not in verified.NOT_RESUMED]
                kept = [r for r in rows if r in good[:keep] or r.id in needed]
                dropped = [r for r in rows if r not in kept]
                for old in dropped:
                    s.delete(old)
        if refused is not None:
            raise refused
        return [old.key for old in dropped if old.key not in {r.key for r in kept}]

    def key(self, checkpoint_id: int) -> str | None:
        """Where a recorded checkpoint is in storage (None: retention dropped it)."""
        with self.db.read() as s:
            return s.scalar(select(Checkpoint.key).where(Checkpoint.id == checkpoint_id))

    def probability(self, job_id: str, machine_id: str) -> float:
        """How likely a checkpoint this machine just made for the job is checked (and so read
        by the coordinator): checks.probability."""
        with self.db.read() as s:
            return checks.probability(s, job_row(s, job_id), machine_id)

    def latest(self, job_id: str) -> CheckpointView | None:
        with self.db.read() as s:
            row = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id, RESUMABLE)
                            .order_by(Checkpoint.epoch.desc(), Checkpoint.id.desc()).limit(1)).first()
            return CheckpointView.from_row(row) if row is not None else None

    def of(self, job_id: str) -> list[CheckpointView]:
        with self.db.read() as s:
            rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                                  .order_by(Checkpoint.epoch, Checkpoint.id)))
            checking = checks.protected(s, job_id, only_checked=True)
            return [dataclasses.replace(CheckpointView.from_row(r), verdict="checking")
                    if r.verdict is None and r.id in checking else CheckpointView.from_row(r)
                    for r in rows]
