"""The tables. Changes here need an Alembic revision (tests check head == models)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    case,
    select,
    type_coerce,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Aware UTC datetimes on every database (SQLite would hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


MAX_LOG_CHUNK = 64 * 1024


def clean(text: str | None) -> str | None:
    """Text from agents as stored: no NUL (PostgreSQL refuses it in text columns)."""
    return text.replace("\x00", "\\0") if text else text


class Base(DeclarativeBase):
    type_annotation_map = {dt.datetime: UTCDateTime}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # The app that submitted it: only it (and admins) may see or cancel the job. NULL only
    # for jobs stored before apps existed (admins see those).
    owner_id: Mapped[str | None] = mapped_column(String(36), index=True)
    # Unique per owner: one app's ids say nothing about another's.
    client_job_id: Mapped[str | None] = mapped_column(String(128))
    name: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec_json: Mapped[str] = mapped_column(Text)
    context_key: Mapped[str] = mapped_column(String(200))
    context_sha256: Mapped[str] = mapped_column(String(64), index=True)  # shared images
    # The current attempt number; also the fencing token of that attempt.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    # Attempts handed back by a graceful drain: they do not count against max_attempts.
    drained: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpus_needed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # resources.require_limits as a bit mask over protocol.spec.LIMITS: a claim takes the job
    # only if the machine enforces every one (limits_needed & what it lacks = 0).
    limits_needed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # What one machine must be able to give it (Resources.cpus, memory_mb, disk_needed_mb):
    # a claim takes the job only if the asking machine has that much.
    cpus_needed: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    memory_needed_mb: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    disk_needed_mb: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The provider share the job's files come from (spec.share): only a machine sharing it
    # takes the job. NULL for almost every job, which keeps the claim's fast path.
    share: Mapped[str | None] = mapped_column(String(64))
    # Sharded jobs (shards_total > 0): the job stays QUEUED while shards wait for a machine,
    # is RUNNING once the last one is handed out, and ends when every shard has ended.
    shards_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    shards_queued: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    shards_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    shards_failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    shards_sha256: Mapped[str | None] = mapped_column(String(64))
    # A verified job (spec.verify) is never leased itself: its replicas are, each a job of
    # its own with replica_of set to it (coordinator/quorum.py). `replicas`: how many it has
    # made so far (0 on every other job, which is what the claim's filter reads).
    replicas: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    replica_of: Mapped[str | None] = mapped_column(String(36), index=True)
    # Jobs whose machines are kept apart (replica_machines): a replica's verified job, or
    # "ckpt-<id>" for the checks of one checkpoint. NULL: any machine may take the job.
    apart: Mapped[str | None] = mapped_column(String(36))
    # A check (coordinator/checks.py): the job recomputes checkpoint `check_of` (of another
    # job) from checkpoint `check_from` (NULL: from the start) and ends when it has saved it.
    check_of: Mapped[int | None] = mapped_column(Integer, index=True)
    check_from: Mapped[int | None] = mapped_column(Integer)
    # A comparison (spec.verify.compare): the job runs the verified job `compare_of`'s compare
    # command on the outputs of its replicas `compare_pair` ("<id>,<id>"); exit 0: alike.
    compare_of: Mapped[str | None] = mapped_column(String(36), index=True)
    compare_pair: Mapped[str | None] = mapped_column(String(80))
    # The checkpoint the current attempt resumed from (None: from the start), set at its lease.
    resume_id: Mapped[int | None] = mapped_column(Integer)
    # A replica's /output as the coordinator read it (quorum.output_digest), to compare.
    output_digest: Mapped[str | None] = mapped_column(String(80))
    # Why the job's result cannot be trusted: it came from a machine quarantined since.
    tainted: Mapped[str | None] = mapped_column(Text)
    machine_id: Mapped[str | None] = mapped_column(String(36))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column()
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    result: Mapped[str | None] = mapped_column(Text)
    output_key: Mapped[str | None] = mapped_column(String(200))
    # [[path, size], ...] of the files in that output, as the agent listed them (bounded)
    output_files_json: Mapped[str | None] = mapped_column(Text)
    limits_json: Mapped[str | None] = mapped_column(Text)
    # Each remote FROM (normalized name:tag) and the digest it resolved to at submit: every
    # machine builds on the same base (coordinator/bases.py).
    bases_json: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column()
    updated_at: Mapped[dt.datetime] = mapped_column()

    __table_args__ = (
        Index("ix_jobs_state_created", "state", "created_at"),
        # A CPU-only machine's lease looks only at jobs that need no GPU: one index seek,
        # in the claim's own order (created_at, id), so that no plan sorts the queue: with
        # statistics not yet gathered after a burst of submissions, PostgreSQL sorted all of
        # it (100k queued: 135 ms a lease, against 0.05).
        Index("ix_jobs_state_gpus_created", "state", "gpus_needed", "created_at", "id"),
        UniqueConstraint("owner_id", "client_job_id", name="uq_jobs_owner_client_job_id"),
    )


class JobEvent(Base):
    """The job's history: every transition and every refused call, in order."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[dt.datetime] = mapped_column()
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="")


class JobRefusal(Base):
    """A machine that cannot run a job (CannotRunHere: a base it lacks, too little disk):
    the claim never offers it that job again."""

    __tablename__ = "job_refusals"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    machine_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    at: Mapped[dt.datetime] = mapped_column()
    reason: Mapped[str] = mapped_column(Text, default="")


class LogChunk(Base):
    __tablename__ = "log_chunks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    seq: Mapped[int] = mapped_column(BigInteger)
    text: Mapped[str] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "stream", "seq", name="uq_log_chunk"),
        Index("ix_log_chunks_job", "job_id", "id"),
    )


class FleetProcess(Base):
    """A coordinator process holding agents' streams (fleet.py), and when it last said it is
    alive: a machine connected to it is seen as long as it is, so an idle fleet costs the
    database one row per process every SEEN_S, not one per machine."""

    __tablename__ = "fleet_processes"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    alive_at: Mapped[dt.datetime] = mapped_column()


def _later_of_own_and_process(connected_to: Any, last_seen_at: Any) -> Any:
    """Machine.seen_at's expression: the process's alive_at while it is the later."""
    alive = select(FleetProcess.alive_at).where(FleetProcess.id == connected_to).scalar_subquery()
    return type_coerce(case((alive > last_seen_at, alive), else_=last_seen_at), UTCDateTime)


class Machine(Base):
    __tablename__ = "machines"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # The machine's own Ed25519 public key (base64, raw) and its fingerprint; the private
    # half never leaves the machine.
    public_key: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending, approved, revoked
    address: Mapped[str] = mapped_column(String(100), default="", server_default="")
    # Whose machine it is, as the admin who approved it said ("": not said): a verified job's
    # replicas (and a checkpoint's checks) never run on two machines of one owner.
    owner: Mapped[str] = mapped_column(String(200), default="", server_default="")
    capabilities_json: Mapped[str] = mapped_column(Text, default="{}")
    gpus_json: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    registered_at: Mapped[dt.datetime] = mapped_column()
    last_seen_at: Mapped[dt.datetime] = mapped_column()
    # The process whose stream it is connected on (None: none since it last left one).
    connected_to: Mapped[str | None] = mapped_column(String(36))
    # When it was last heard from: last_seen_at (a call; its stream's start or end), or while
    # its stream's process is alive, when that process last said so, whichever is later.
    seen_at: Mapped[dt.datetime] = column_property(
        _later_of_own_and_process(connected_to, last_seen_at), expire_on_flush=False)
    # Its record against quorums (coordinator/quorum.py): answers that agreed and that did
    # not, the agreeing answers in a row since its last disagreement (adaptive verification
    # trusts it from quorum.TRUSTED_AFTER on), when it last agreed, and why it is quarantined.
    agreed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    disagreed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    streak: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_agreed_at: Mapped[dt.datetime | None] = mapped_column()
    quarantine: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (UniqueConstraint("public_key", name="uq_machines_public_key"),)


class ReplicaMachine(Base):
    """A machine that took a replica of a verified job (with every machine at its address):
    it is never given another replica of that job (the same one again, after a drain, it
    may be). The same for the checks of a checkpoint (job_id "ckpt-<id>"), where the machine
    that made the checkpoint is entered first."""

    __tablename__ = "replica_machines"

    job_id: Mapped[str] = mapped_column(String(36), primary_key=True)  # the verified job
    machine_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    replica_id: Mapped[str] = mapped_column(String(36))  # the replica it took


class MachineEpoch(Base):
    """One row, counting changes of any machine's status (approved, revoked, expired): a
    coordinator process re-reads it every second and drops the machine records it holds
    when it moved, instead of re-reading every machine every second."""

    __tablename__ = "machine_epoch"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)


class App(Base):
    """Whoever submits and watches jobs (a researcher's CLI, a service): its public key only."""

    __tablename__ = "apps"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # the signatures' keyid
    name: Mapped[str] = mapped_column(String(100), unique=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column()
    revoked_at: Mapped[dt.datetime | None] = mapped_column()


class Invite(Base):
    """A one-time code that turns into an app: only its SHA-256 is kept."""

    __tablename__ = "invites"

    code_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_by: Mapped[str] = mapped_column(String(36))
    expires_at: Mapped[dt.datetime] = mapped_column()
    used_at: Mapped[dt.datetime | None] = mapped_column()


class Nonce(Base):
    """Nonces of signed requests still inside their time window: a second use is a replay.
    Shared by every coordinator process on the database (the primary key decides)."""

    __tablename__ = "nonces"

    signer: Mapped[str] = mapped_column(String(80), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)


class RateCounter(Base):
    """One window's count of a rate limit (campugrid.coordinator.ratelimits): shared by every
    coordinator process on the database, so a limit holds however many processes serve."""

    __tablename__ = "rate_counters"

    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[float] = mapped_column(Float, index=True)  # seconds since the epoch


class Upload(Base):
    """A file an app uploaded for one job (an upload ticket): bound to its size and sha256,
    good for about ten minutes until a job takes it, deleted once that job has ended."""

    __tablename__ = "uploads"

    id: Mapped[str] = mapped_column(String(80), primary_key=True)  # the ticket
    owner_id: Mapped[str] = mapped_column(String(36))
    filename: Mapped[str] = mapped_column(String(200))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column()
    expires_at: Mapped[dt.datetime] = mapped_column()
    job_id: Mapped[str | None] = mapped_column(String(36), index=True)  # the one job that used it


class Shard(Base):
    """One payload of a sharded job: a task of its own, run inside a machine's session."""

    __tablename__ = "shards"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16))  # queued, running, succeeded, failed
    cost: Mapped[float] = mapped_column(Float)
    payload_json: Mapped[str] = mapped_column(Text)
    tries: Mapped[int] = mapped_column(Integer, default=0)  # sessions lost while holding it
    session_id: Mapped[int | None] = mapped_column(BigInteger)  # the session running it
    machine_id: Mapped[str | None] = mapped_column(String(36))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    result_json: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    finished_at: Mapped[dt.datetime | None] = mapped_column()
    # A verified sharded job (spec.verify): rows 0..total-1 are its shards as researchers see
    # them, never handed out; each is run as copies (rows from total on, copy_of naming it)
    # on different machines, and takes the answer a quorum of them agrees on. NULL elsewhere.
    copy_of: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        # Next shard of a job: the heaviest (fast machines) or lightest (slow ones) queued.
        Index("ix_shards_pick", "job_id", "state", "cost", "idx"),
    )


class ShardSession(Base):
    """One machine working through shards of one job in one warm sandbox. Its id is the
    fencing token of every call the machine makes about it."""

    __tablename__ = "shard_sessions"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    machine_id: Mapped[str] = mapped_column(String(36))
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    lost: Mapped[bool] = mapped_column(Boolean, default=False)  # ended by lease expiry
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column()
    started_at: Mapped[dt.datetime] = mapped_column()

    __table_args__ = (Index("ix_shard_sessions_active", "active", "lease_expires_at"),)


class Checkpoint(Base):
    """An epoch checkpoint in object storage, recorded once its size and digest checked out."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(String(300))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column()
    machine_id: Mapped[str | None] = mapped_column(String(36))  # the machine that made it
    # The epoch its attempt resumed from (None: it started from nothing).
    resumed_from: Mapped[int | None] = mapped_column(BigInteger)
    # The checkpoint it was computed from: its attempt's previous one, or the one its attempt
    # resumed from (None: the start). Checks start there; a rejection follows these links.
    parent_id: Mapped[int | None] = mapped_column(Integer)
    # Its files and bytes as the coordinator read them (quorum.output_digest), for checks.
    content_digest: Mapped[str | None] = mapped_column(String(80))
    # How the job's own code named it (a framework's checkpoint-<step>): shown beside the epoch.
    label: Mapped[str | None] = mapped_column(String(200))
    # A check's verdict (coordinator/checks.py): "agreed"; never resumed from: "rejected" (a
    # check outvoted it, or it was made from one that was), "untrusted" (its machine was
    # quarantined and no check agreed with it, or it was made from such a one),
    # "unverifiable" (sampled, but no check could recompute it), "disputed" (no two
    # recomputations agreed); None: not checked (or not yet).
    verdict: Mapped[str | None] = mapped_column(String(16))


class GpuReservation(Base):
    """GPU memory promised to one attempt: taken in the same transaction as the lease, and
    released when that attempt ends in any way."""

    __tablename__ = "gpu_reservations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    machine_id: Mapped[str] = mapped_column(String(36))
    gpu_uuid: Mapped[str] = mapped_column(String(100))
    memory_mb: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_gpu_reservations_machine", "machine_id", "gpu_uuid"),)


class User(Base):
    """A person signing in to the web console: an argon2id password hash and a TOTP secret
    (encrypted with a key kept outside the database). Their jobs are those of their app."""

    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    app_id: Mapped[str] = mapped_column(ForeignKey("apps.id"))
    password_hash: Mapped[str] = mapped_column(String(200), default="")  # "" until enrolled
    totp_secret: Mapped[str] = mapped_column(Text, default="")  # encrypted; "" until enrolment
    totp_last_step: Mapped[int] = mapped_column(BigInteger, default=0)  # a code works once
    enrol_sha256: Mapped[str | None] = mapped_column(String(64), unique=True)
    enrol_expires_at: Mapped[dt.datetime | None] = mapped_column()
    enrolled_at: Mapped[dt.datetime | None] = mapped_column()
    failed_logins: Mapped[int] = mapped_column(Integer, default=0)
    locked_until: Mapped[dt.datetime | None] = mapped_column()
    # When they acknowledged that providers can read everything a job holds.
    acknowledged_at: Mapped[dt.datetime | None] = mapped_column()
    created_at: Mapped[dt.datetime] = mapped_column()


class ConsoleSession(Base):
    """A signed-in browser: only the SHA-256 of its cookie is kept."""

    __tablename__ = "console_sessions"

    id_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column()
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)


class GpuSample(Base):
    """One GPU's memory in one minute, as its agent last reported it then, with what the
    platform had reserved on it: the console's memory chart. Kept for a day."""

    __tablename__ = "gpu_samples"

    machine_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    gpu_uuid: Mapped[str] = mapped_column(String(100), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True, index=True)  # Unix minutes
    name: Mapped[str] = mapped_column(String(200))
    shared: Mapped[bool] = mapped_column(Boolean)  # Apple unified memory: the system's own
    total_mb: Mapped[int] = mapped_column(BigInteger)
    free_mb: Mapped[int] = mapped_column(BigInteger)  # after other processes and the owner's reserve
    reserved_mb: Mapped[int] = mapped_column(BigInteger)  # promised to the platform's jobs


class MetricsToken(Base):
    """A scrape token for /metrics (Prometheus sends it as a bearer token): only its SHA-256
    is kept."""

    __tablename__ = "metrics_tokens"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_by: Mapped[str] = mapped_column(String(36))  # the admin app that minted it
    created_at: Mapped[dt.datetime] = mapped_column()


class ImageBuild(Base):
    """A job image one machine built and pushed to the registry, by the build's key (a digest
    of the job's context and of what else determines the build on that machine)."""

    __tablename__ = "image_builds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    build_key: Mapped[str] = mapped_column(String(64))
    context_sha256: Mapped[str] = mapped_column(String(64), index=True)  # what GC looks at
    digest: Mapped[str] = mapped_column(String(80))  # the manifest's, "sha256:…"
    machine_id: Mapped[str] = mapped_column(String(36))
    job_id: Mapped[str] = mapped_column(String(36))  # the job whose task built it
    created_at: Mapped[dt.datetime] = mapped_column()
    used_at: Mapped[dt.datetime] = mapped_column()  # last handed out to pull
    # Its machine was quarantined: never handed out again, even if an admin reinstates it.
    withdrawn_at: Mapped[dt.datetime | None] = mapped_column()

    __table_args__ = (UniqueConstraint("build_key", "machine_id", name="uq_image_builds_key_machine"),)


class ImagePull(Base):
    """A task was sent to pull a build of its image: when the build's only maker is later
    quarantined, the job that ran it is marked tainted (verified.quarantine). A build two
    machines agree on ("verified" reuse) names no single maker."""

    __tablename__ = "image_pulls"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(36))
    digest: Mapped[str] = mapped_column(String(80))
    builder: Mapped[str | None] = mapped_column(String(36), index=True)  # its only maker
    at: Mapped[dt.datetime] = mapped_column()


class ImageClaim(Base):
    """The one machine building an image for others to pull ("first" reuse), while the hold
    that claimed it (a job's attempt or a shard session: its kind and fencing token) is live."""

    __tablename__ = "image_claims"

    build_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(36))
    hold_kind: Mapped[str] = mapped_column(String(16), default="attempt",
                                           server_default="attempt")  # views.HoldKind
    token: Mapped[int] = mapped_column(BigInteger)
    machine_id: Mapped[str] = mapped_column(String(36))
    expires_at: Mapped[dt.datetime] = mapped_column()  # a bound, even for a live task
