"""Upload tickets: a file that exists nowhere else, sent by its app for one job.

A ticket is good for one file (bound to its size and sha256), one job and about ten minutes.
The app PUTs the file to the ticket's presigned URL; the submit that names the ticket checks
the stored object against both and takes the ticket in the job's own transaction, so a second
use, another file or a late use is refused. The object is deleted once its job has ended (or
its ticket expired unused).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import secrets

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import Job, Upload
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import SHA256_RE
from campugrid.protocol.states import JobState

TICKET_TTL_S = 600
FILENAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclasses.dataclass(frozen=True)
class UploadView:
    ticket: str
    owner_id: str
    filename: str
    size: int
    sha256: str
    key: str
    expires_at: dt.datetime
    job_id: str | None

    @classmethod
    def from_row(cls, r: Upload) -> UploadView:
        return cls(r.id, r.owner_id, r.filename, r.size, r.sha256, r.key, r.expires_at, r.job_id)


class Uploads:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, owner: str, filename: str, size: int, sha256: str, *, max_bytes: int,
               ttl_s: float = TICKET_TTL_S) -> UploadView:
        if not FILENAME_RE.match(filename):
            raise InvalidInput(f"filename {filename[:80]!r}: 1 to 200 of A-Z a-z 0-9 . _ - "
                               "(it becomes /data/<name>/<filename>)")
        if not 0 < size <= max_bytes:
            raise InvalidInput(f"size: 1 byte to {max_bytes // 1024**2} MiB, not {size}")
        if not SHA256_RE.match(sha256):
            raise InvalidInput("sha256: 64 lowercase hex digits")
        ticket = "upl_" + secrets.token_urlsafe(24)
        now = utcnow()
        row = Upload(id=ticket, owner_id=owner, filename=filename, size=size, sha256=sha256,
                     key=f"uploads/{ticket}", created_at=now,
                     expires_at=now + dt.timedelta(seconds=ttl_s))
        with self.db.tx() as s:
            s.add(row)
        return UploadView.from_row(row)

    def get(self, ticket: str, owner: str | None = None) -> UploadView:
        """The ticket, if `owner` made it (None: any owner, for the lease path)."""
        with self.db.read() as s:
            row = s.get(Upload, ticket)
        if row is None or (owner is not None and row.owner_id != owner):
            raise InvalidInput(f"no upload ticket {ticket[:40]!r} of yours (make one with "
                               "POST /v1/uploads or `campugrid submit --upload FILE`)")
        return UploadView.from_row(row)

    def ended(self, now: dt.datetime | None = None) -> list[UploadView]:
        """Uploads to delete: their job has ended, or they expired unused."""
        now = now or utcnow()
        final = [s.value for s in JobState if s.final]
        with self.db.read() as s:
            rows = s.scalars(select(Upload).outerjoin(Job, Job.id == Upload.job_id).where(or_(
                Job.state.in_(final), and_(Upload.job_id.is_(None), Upload.expires_at < now))))
            return [UploadView.from_row(r) for r in rows]

    def forget(self, ticket: str) -> None:
        with self.db.tx() as s:
            row = s.get(Upload, ticket)
            if row is not None:
                s.delete(row)


def take(s: Session, tickets: list[str], owner: str, job_id: str) -> None:
    """In the submitting transaction: each ticket becomes the job's, if it is still unused,
    unexpired and the owner's; InvalidInput (and nothing stored) otherwise."""
    now = utcnow()
    for ticket in tickets:
        taken = s.execute(update(Upload).where(
            Upload.id == ticket, Upload.owner_id == owner, Upload.job_id.is_(None),
            Upload.expires_at >= now).values(job_id=job_id)).rowcount  # type: ignore[attr-defined]
        if taken != 1:
            raise InvalidInput(f"upload ticket {ticket[:40]!r} was used or has expired "
                               "meanwhile; upload the file again")
