"""What the REST API takes and answers: Pydantic models live here and stop here."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel

from campugrid.coordinator.apps import AppView
from campugrid.coordinator.machines import MachineRecord
from campugrid.coordinator.metrics import TokenView
from campugrid.coordinator.scheduler import MachineView
from campugrid.coordinator.users import UserView
from campugrid.coordinator.views import CheckpointView, JobView
from campugrid.protocol.states import JobState


class EventOut(BaseModel):
    at: dt.datetime
    attempt: int
    kind: str
    detail: str


class ShardCounts(BaseModel):
    total: int
    queued: int  # waiting for a machine
    running: int
    done: int  # ended, succeeded or failed
    failed: int


class ShardOut(BaseModel):
    index: int
    state: str  # queued, running, succeeded, failed, cancelled
    cost: float
    tries: int  # sessions lost while holding it
    machine_id: str | None
    exit_code: int | None
    result: Any  # the shard's result: its result.json, or its last line of stdout
    reason: str | None
    finished_at: dt.datetime | None
    # A verified job's shard: each copy that ended: [machine, result, agreed with the answer
    # taken (null while undecided)].
    copies: list[tuple[str | None, Any, bool | None]] = []


class ReplicaOut(BaseModel):
    """One replica of a verified job: where it ran and what it answered."""

    id: str
    state: JobState
    machine_id: str | None
    exit_code: int | None
    result: str | None
    output_digest: str | None  # its /output as the coordinator read it
    agreed: bool | None  # its answer is the one the job took (None: no answer, or undecided)

    @classmethod
    def of(cls, job: JobView, agreed: bool | None) -> ReplicaOut:
        return cls(id=job.id, state=job.state, machine_id=job.machine_id,
                   exit_code=job.exit_code, result=job.result,
                   output_digest=job.output_digest, agreed=agreed)


class CheckpointOut(BaseModel):
    """One checkpoint kept in storage: who made it, from what, and what its check found."""

    epoch: int
    attempt: int
    machine_id: str | None
    resumed_from: int | None  # the epoch its attempt resumed from (None: the start)
    size: int
    sha256: str
    created_at: dt.datetime
    # agreed, rejected (never resumed from), disputed, checking; None: not checked
    verdict: str | None = None
    label: str | None = None  # how the job's own code named it (a framework's checkpoint-20)

    @classmethod
    def of(cls, c: CheckpointView) -> CheckpointOut:
        return cls(epoch=c.epoch, attempt=c.attempt, machine_id=c.machine_id,
                   resumed_from=c.resumed_from, size=c.size, sha256=c.sha256,
                   created_at=c.created_at, verdict=c.verdict, label=c.label)


class JobOut(BaseModel):
    id: str
    client_job_id: str | None
    name: str | None
    state: JobState
    attempt: int
    max_attempts: int
    machine_id: str | None
    exit_code: int | None
    reason: str | None
    result: str | None
    has_output: bool
    output_files: list[tuple[str, int]] = []  # (path in /output, size), as its agent listed them
    limits: dict[str, str]
    bases: dict[str, str] = {}  # each FROM on a registry -> the digest it was resolved to
    spec: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime
    waiting_reason: str | None = None  # queued jobs: why no machine has taken it yet
    shards: ShardCounts | None = None  # sharded jobs only
    events: list[EventOut] | None = None
    tainted: str | None = None  # why its result cannot be trusted (its machine was caught)
    replica_of: str | None = None  # a replica: the verified job it is one of
    replicas: list[ReplicaOut] | None = None  # a verified job's, in a single job's answer
    checkpoints: list[CheckpointOut] | None = None  # in a single job's answer

    @classmethod
    def of(cls, job: JobView, events: list[EventOut] | None = None,
           waiting_reason: str | None = None,
           replicas: list[ReplicaOut] | None = None,
           checkpoints: list[CheckpointOut] | None = None) -> JobOut:
        return cls(
            id=job.id, client_job_id=job.client_job_id, name=job.name, state=job.state,
            attempt=job.attempt, max_attempts=job.max_attempts, machine_id=job.machine_id,
            exit_code=job.exit_code, reason=job.reason, result=job.result,
            has_output=job.output_key is not None, output_files=list(job.output_files),
            limits=job.limits, bases=job.bases,
            spec=_redacted(job),
            created_at=job.created_at, updated_at=job.updated_at, events=events,
            waiting_reason=waiting_reason,
            shards=ShardCounts(
                total=job.shards_total, queued=job.shards_waiting, done=job.shards_done,
                failed=job.shards_failed,
                running=job.shards_total - job.shards_waiting - job.shards_done)
            if job.shards_total else None,
            tainted=job.tainted, replica_of=job.replica_of, replicas=replicas,
            checkpoints=checkpoints,
        )


def _redacted(job: JobView) -> dict[str, Any]:
    """The spec as shown: env values may be tokens, so only their names are served."""
    spec = job.spec.to_dict()
    spec["env"] = {k: "(hidden)" for k in spec["env"]}
    return spec


class AppOut(BaseModel):
    id: str
    name: str
    fingerprint: str
    admin: bool
    created_at: dt.datetime
    revoked_at: dt.datetime | None

    @classmethod
    def of(cls, a: AppView) -> AppOut:
        return cls(id=a.id, name=a.name, fingerprint=a.fingerprint, admin=a.admin,
                   created_at=a.created_at, revoked_at=a.revoked_at)


class InviteIn(BaseModel):
    name: str
    admin: bool = False


class InviteOut(BaseModel):
    name: str
    code: str  # shown once: only its digest is kept
    expires_at: dt.datetime
    server: str
    pin: str  # the coordinator certificate's fingerprint, for https and for agents
    command: str  # what the new app runs


class LoginIn(BaseModel):
    invite: str
    public_key: str  # base64 of the new app's 32-byte Ed25519 public key


class MachineOut(BaseModel):
    id: str
    name: str
    status: str  # pending, approved, quarantined, revoked
    fingerprint: str
    address: str
    registered_at: dt.datetime
    last_seen_at: dt.datetime
    held: str  # why its owner holds it now (paused, a listed program runs); "" takes work
    online: bool  # approved and heard from in the last 30 s (a busy machine is online)
    busy: str  # the job it runs now (an id prefix); "" while it asks for work
    cpus: int  # what one task can be given there, as it last said (0: not said)
    memory_mb: int
    disk_mb: int
    # Its record against quorums of verified jobs: answers that agreed, that did not, the
    # agreeing ones in a row; why it is quarantined ("" when it is not), with the evidence.
    agreed: int = 0
    disagreed: int = 0
    streak: int = 0
    quarantine: str = ""
    owner: str = ""  # whose machine it is, as the admin who approved it said
    runtime: str = ""  # its gVisor as its agent said: `runsc <version>` (the version is dated)

    @classmethod
    def of(cls, m: MachineRecord, online: MachineView | None = None) -> MachineOut:
        return cls(id=m.id, name=m.name, status=m.status.value, fingerprint=m.fingerprint,
                   address=m.address, registered_at=m.registered_at, last_seen_at=m.last_seen_at,
                   held=m.held, online=online is not None,
                   busy=online.busy if online is not None else "", cpus=m.cpus,
                   memory_mb=m.memory_mb, disk_mb=m.disk_mb, agreed=m.agreed,
                   disagreed=m.disagreed, streak=m.streak, quarantine=m.quarantine,
                   owner=m.owner, runtime=m.runtime)


class JoinOut(BaseModel):
    grpc_address: str
    pin: str
    command: str


class UserIn(BaseModel):
    name: str
    app: str | None = None  # the app they act as (default: a new app of their own name)
    admin: bool = False  # for a new app: is it an admin


class UserOut(BaseModel):
    name: str
    app: str
    admin: bool
    enrolled: bool
    locked_until: dt.datetime | None

    @classmethod
    def of(cls, u: UserView) -> UserOut:
        return cls(name=u.name, app=u.app_name, admin=u.admin, enrolled=u.enrolled,
                   locked_until=u.locked_until)


class NewUserOut(UserOut):
    link: str  # the one-time enrolment page (shown once: only its digest is kept)
    expires_at: dt.datetime


class ScrapeTokenIn(BaseModel):
    name: str = "prometheus"


class ScrapeTokenOut(BaseModel):
    name: str
    created_by: str  # the admin app's id
    created_at: dt.datetime

    @classmethod
    def of(cls, t: TokenView) -> ScrapeTokenOut:
        return cls(name=t.name, created_by=t.created_by, created_at=t.created_at)


class NewScrapeTokenOut(ScrapeTokenOut):
    token: str  # shown once: only its digest is kept


class UploadIn(BaseModel):
    filename: str  # it becomes /data/<dataset name>/<filename>
    size: int
    sha256: str


class UploadOut(BaseModel):
    ticket: str  # name it in a dataset: {"name": ..., "ticket": ...}
    url: str  # PUT the file here (presigned, until expires_at)
    expires_at: dt.datetime


class SharedFileOut(BaseModel):
    path: str  # inside the share
    size: int
    sha256: str
    machines: int  # approved machines online that share this very file


class ShareOut(BaseModel):
    name: str
    files: list[SharedFileOut]


class LogChunkOut(BaseModel):
    id: int
    attempt: int
    stream: str
    text: str


class LogsOut(BaseModel):
    chunks: list[LogChunkOut]
    next_after: int
    state: JobState
