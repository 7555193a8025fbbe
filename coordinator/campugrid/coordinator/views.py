"""What the store and the coordinator hand out: plain, immutable views of rows and leases."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import functools
import json
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Row

from campugrid.coordinator.models import Checkpoint, Job
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState


class HoldKind(enum.Enum):
    """What a machine holds (holds.py): a plain job's attempt, or a shard session."""

    ATTEMPT = "attempt"
    SESSION = "session"


@dataclasses.dataclass(frozen=True)
class HoldRef:
    """What a call about held work names: the job, the kind of hold, the fencing token the
    lease gave (an attempt's number, or a session's id), and the machine calling."""

    job_id: str
    kind: HoldKind
    token: int
    machine_id: str


@dataclasses.dataclass(frozen=True)
class ShardTask:
    index: int
    payload_json: str
    cost: float


@dataclasses.dataclass(frozen=True)
class ShardResult:
    index: int
    succeeded: bool
    exit_code: int | None
    result_json: str | None  # JSON text, at most spec.MAX_SHARD_RESULT bytes
    reason: str | None


@dataclasses.dataclass(frozen=True)
class ShardView:
    index: int
    state: str
    cost: float
    tries: int
    machine_id: str | None
    exit_code: int | None
    result: Any
    reason: str | None
    finished_at: dt.datetime | None
    # A verified job's shard: each copy that ended, (machine, its result, whether it is the
    # answer taken: None while undecided or for no answer).
    copies: tuple[tuple[str | None, Any, bool | None], ...] = ()


@functools.lru_cache(maxsize=4096)
def stored_spec(text: str) -> JobSpec:
    """A stored spec, parsed (specs never change once stored; sweeps share them)."""
    return JobSpec.from_json(text)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclasses.dataclass(frozen=True)
class JobView:
    id: str
    client_job_id: str | None
    name: str | None
    state: JobState
    spec: JobSpec
    context_key: str
    attempt: int
    max_attempts: int
    machine_id: str | None
    lease_expires_at: dt.datetime | None
    exit_code: int | None
    reason: str | None
    result: str | None
    output_key: str | None
    limits: dict[str, str]
    created_at: dt.datetime
    updated_at: dt.datetime
    spec_json: str = ""  # the spec as stored (what agents get)
    shards_total: int = 0  # 0: not a sharded job
    shards_queued: int = 0
    shards_done: int = 0
    shards_failed: int = 0
    bases: dict[str, str] = dataclasses.field(default_factory=dict)  # remote FROM -> digest
    output_files: tuple[tuple[str, int], ...] = ()  # (path in /output, size), as listed
    owner_id: str = ""  # the app that submitted it ("" for none)
    replicas: int = 0  # a verified job's replicas made so far (0: not a verified job)
    replica_of: str | None = None  # a replica's verified job
    output_digest: str | None = None  # a replica's /output, as quorum.output_digest read it
    tainted: str | None = None  # why its result cannot be trusted any more
    # A comparison's two replicas (verified.py): their outputs are its inputs a and b.
    compare_pair: tuple[str, ...] | None = None

    @property
    def shards_waiting(self) -> int:
        """Shards no machine holds yet, as researchers count them: a verified job's counter
        counts copies, which only bound it."""
        return min(self.shards_queued, self.shards_total - self.shards_done)

    @classmethod
    def from_row(cls, row: Job | Row[Any] | SimpleNamespace) -> JobView:
        return cls(
            id=row.id, client_job_id=row.client_job_id, name=row.name,
            state=JobState(row.state), spec=stored_spec(row.spec_json),
            context_key=row.context_key, attempt=row.attempt, max_attempts=row.max_attempts,
            machine_id=row.machine_id, lease_expires_at=row.lease_expires_at,
            exit_code=row.exit_code, reason=row.reason, result=row.result,
            output_key=row.output_key, limits=json.loads(row.limits_json or "{}"),
            created_at=row.created_at, updated_at=row.updated_at,
            spec_json=row.spec_json, shards_total=row.shards_total or 0, shards_queued=row.shards_queued or 0,
            shards_done=row.shards_done or 0, shards_failed=row.shards_failed or 0,
            bases=json.loads(row.bases_json or "{}"),
            output_files=tuple((str(p), int(n)) for p, n in
                               json.loads(row.output_files_json or "[]")),
            owner_id=row.owner_id or "",
            replicas=getattr(row, "replicas", 0) or 0, replica_of=getattr(row, "replica_of", None),
            output_digest=getattr(row, "output_digest", None),
            tainted=getattr(row, "tainted", None),
            compare_pair=(tuple(str(row.compare_pair).split(","))
                          if getattr(row, "compare_pair", None) else None),
        )


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a lease hands out: the job as the new attempt, its GPUs, where to resume from;
    for a sharded job, the session it opened and that session's first shard."""

    job: JobView
    gpu_uuids: tuple[str, ...]
    resume: CheckpointView | None
    session: int | None = None
    shard: ShardTask | None = None

    @property
    def token(self) -> int:
        """The fencing token of the hold it gives: the session's id, or the attempt's number."""
        return self.session if self.session is not None else self.job.attempt

    def hold(self, machine_id: str) -> HoldRef:
        """The hold this lease gives `machine_id`: the session it opened, or the attempt."""
        if self.session is not None:
            return HoldRef(self.job.id, HoldKind.SESSION, self.session, machine_id)
        return HoldRef(self.job.id, HoldKind.ATTEMPT, self.job.attempt, machine_id)


@dataclasses.dataclass(frozen=True)
class EventView:
    at: dt.datetime
    attempt: int
    kind: str
    detail: str


@dataclasses.dataclass(frozen=True)
class CheckpointView:
    job_id: str
    attempt: int
    epoch: int
    key: str
    size: int
    sha256: str
    created_at: dt.datetime
    machine_id: str | None = None  # the machine that made it (None: made before this was kept)
    resumed_from: int | None = None  # the epoch its attempt resumed from (None: from nothing)
    # Its check (coordinator/checks.py): "agreed", "rejected", "disputed", "checking" (a check
    # runs); None: not checked.
    verdict: str | None = None
    label: str | None = None  # how the job's own code named it (a framework's checkpoint-20)

    @classmethod
    def from_row(cls, r: Checkpoint | Row[Any]) -> CheckpointView:
        return cls(r.job_id, r.attempt, r.epoch, r.key, r.size, r.sha256, r.created_at,
                   getattr(r, "machine_id", None), getattr(r, "resumed_from", None),
                   getattr(r, "verdict", None), getattr(r, "label", None))


@dataclasses.dataclass(frozen=True)
class LogView:
    id: int
    attempt: int
    stream: str
    text: str


@dataclasses.dataclass(frozen=True)
class DatasetFile:
    path: str
    url: str
    size: int
    sha256: str = ""  # what the agent checks the file against before the job starts


@dataclasses.dataclass(frozen=True)
class Lease:
    job: JobView
    lease_seconds: float
    context_url: str
    output_url: str
    datasets: dict[str, list[DatasetFile]]
    resume: CheckpointView | None
    resume_url: str
    gpu_uuids: list[str]
    hold: HoldRef  # what the machine holds by it: the attempt, or a sharded job's session
    shard: ShardTask | None = None  # sharded job: the session's first shard
    shares: dict[str, str] = dataclasses.field(default_factory=dict)  # dataset -> share


@dataclasses.dataclass(frozen=True)
class CheckpointUpload:
    key: str
    upload_id: str
    part_size: int
    part_urls: list[str]
