"""Claiming: the scheduler's hot path, from a machine asking for work to a lease.

A claim takes the oldest queued job the machine can hold, as its next attempt, with a
guarded update (so it is correct on SQLite, and on PostgreSQL where SKIP LOCKED only keeps
concurrent claimers apart), reserves GPU memory on specific GPUs in the same transaction,
and records it in the job's history. For a CPU machine the common case is one statement.
Concurrent claims are committed together (group commit): one fsync for all of them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, Row, bindparam, exists, func, insert, select, update
from sqlalchemy.orm import Session

from campugrid.coordinator.db import Database, dialect_of, job_row
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.models import (
    Base,
    GpuReservation,
    Job,
    JobEvent,
    Machine,
    UTCDateTime,
)
from campugrid.coordinator.scheduler import Demand, MachineView, place
from campugrid.coordinator.sharding import open_session
from campugrid.coordinator.verified import AGREED, NOT_RESUMED, kept_apart, leased_replica
from campugrid.coordinator.views import CheckpointView, Claim, JobView, stored_spec, utcnow
from campugrid.protocol.states import JobState, sources_of


@dataclasses.dataclass
class _PendingClaim:
    machine_id: str
    lease_s: float
    offer: MachineView
    heavy_first: bool
    done: bool = False
    result: Claim | None = None
    error: Exception | None = None


class Claimer:
    """Claims for whoever asks, concurrent claims in one transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._pending: list[_PendingClaim] = []
        self._pending_lock = threading.Lock()
        self._leader = threading.Lock()

    def claim(self, machine_id: str, lease_s: float,
              machine: MachineView | None = None, *, heavy_first: bool = True) -> Claim | None:
        """Lease the oldest queued job this machine can hold, as the next attempt, reserving
        GPU memory on specific GPUs in the same transaction (so it cannot be promised twice).
        A sharded job opens a session instead, holding its heaviest queued shard
        (`heavy_first`, for fast machines) or its lightest."""
        req = _PendingClaim(machine_id, lease_s, machine or MachineView(machine_id, ""),
                            heavy_first)
        with self._pending_lock:
            self._pending.append(req)
        # Group commit: whoever holds the leader lock claims for everyone waiting, in one
        # transaction (one fsync); a lease's cost then no longer includes a commit of its own.
        with self._leader:
            if not req.done:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._claim_batch(batch)
        if req.error is not None:
            raise req.error
        return req.result

    def _claim_batch(self, batch: list[_PendingClaim]) -> None:
        try:
            with self.db.connect() as conn:
                events: list[dict[str, Any]] = []  # the batch's history, in one statement
                for r in batch:
                    r.result = self._claim_in(conn, r.machine_id, r.lease_s, r.offer,
                                              r.heavy_first, events)
                if events:
                    conn.execute(_ADD_EVENT, events)
        except Exception as e:
            if len(batch) == 1:
                batch[0].error = e
            else:  # one claim broke the transaction: the others must not pay for it
                for r in batch:
                    self._claim_batch([r])
                return
        for r in batch:
            r.done = True

    def _claim_in(self, conn: Connection, machine_id: str, lease_s: float, offer: MachineView,
                  heavy_first: bool, events: list[dict[str, Any]]) -> Claim | None:
        """One claim inside the caller's transaction: Core statements built once (below), the
        ORM only for the rarer sharded case."""
        postgres = dialect_of(conn).row_locks
        wants_gpu_jobs = bool(offer.gpus) and offer.gpu_isolation
        if not wants_gpu_jobs and not offer.shares:
            # The common case in one statement: take the oldest queued job if it is a plain
            # CPU job. None: the queue is empty, or a sharded job is first (the path below).
            now = utcnow()
            params = {"machine_id": machine_id, "expires": now + dt.timedelta(seconds=lease_s),
                      "now": now, **_room(machine_id, offer)}
            row = (conn.execute(_TAKE_NEXT_PG, params).first() if postgres
                   else _take_next_sqlite(conn, params))
            if row is not None:
                return self._leased(conn, row, (), 0, now, events)
        for _ in range(20):
            if wants_gpu_jobs and postgres:  # serialise reservations per machine
                conn.execute(_LOCK_MACHINE, {"machine_id": machine_id})
            candidates: list[tuple[Any, str, int, tuple[str, ...], int, int]] = [
                (created, job_id, attempt, (), 0, shards) for job_id, attempt, created, shards
                in conn.execute(_NEXT_CPU_JOB_PG if postgres else _NEXT_CPU_JOB,
                                _room(machine_id, offer))]
            if wants_gpu_jobs:
                found = self._gpu_candidate(conn, machine_id, offer)
                if found is not None:
                    candidates.append(found)
            if offer.shares:
                candidates += [(created, job_id, attempt, (), 0, shards)
                               for job_id, attempt, created, shards in conn.execute(
                                   _next_share_job(offer.shares, postgres),
                                   _room(machine_id, offer))]
            if not candidates:
                return None
            _, job_id, attempt, gpus, gpu_mb, sharded = min(candidates)
            now = utcnow()
            if sharded:
                with Session(bind=conn) as s:
                    opened = open_session(s, job_id, machine_id, lease_s,
                                          heavy_first=heavy_first, gpus=gpus, gpu_mb=gpu_mb,
                                          now=now)
                    s.flush()
                    if opened is None:
                        continue
                    return Claim(JobView.from_row(job_row(s, job_id)), gpus, None, *opened)
            row = conn.execute(_TAKE_JOB, {
                "job_id": job_id, "seen_attempt": attempt, "machine_id": machine_id,
                "expires": now + dt.timedelta(seconds=lease_s), "now": now}).first()
            if row is None:
                continue  # someone else took it between our read and write
            return self._leased(conn, row, gpus, gpu_mb, now, events)
        return None

    @staticmethod
    def _leased(conn: Connection, row: Row[Any] | SimpleNamespace, gpus: tuple[str, ...], gpu_mb: int,
                now: dt.datetime, events: list[dict[str, Any]]) -> Claim:
        """The rest of a lease once the job row is ours: reservations, history, resume."""
        job_id, attempt, machine_id = row.id, row.attempt, row.machine_id
        if gpus:
            conn.execute(insert(GpuReservation), [
                {"job_id": job_id, "attempt": attempt, "machine_id": machine_id,
                 "gpu_uuid": uuid, "memory_mb": gpu_mb} for uuid in gpus])
        detail = f"machine {machine_id}" + (f", GPUs {', '.join(gpus)}" if gpus else "")
        if row.apart is not None:
            kept_apart(conn, row.apart, job_id, machine_id)
        if row.compare_pair:  # a judge does none of the work it may judge, from now on
            kept_apart(conn, _party_of(conn, row.compare_of, row.compare_pair), job_id,
                       machine_id)
        if row.replica_of is not None:
            leased_replica(conn, row.replica_of, job_id, machine_id, now, events)
        events.append({"job_id": job_id, "at": now, "attempt": attempt, "kind": "leased",
                       "detail": detail})
        # Only an attempt records checkpoints: a job leased for the first time has none.
        # A replica resumes only from its own machine's checkpoints: another machine's could
        # be poisoned, and the machine resuming it would answer for it.
        # A check resumes from the checkpoint before the one it recomputes, every attempt.
        resume = (conn.execute(_CHECK_FROM, {"id": row.check_from}).first()
                  if row.check_from is not None else None if row.check_of is not None
                  or attempt <= 1 else
                  conn.execute(_LATEST_CHECKPOINT, {"job_id": job_id}).first()
                  if row.replica_of is None else
                  conn.execute(_LATEST_OWN_CHECKPOINT, {"job_id": job_id,
                                                        "machine_id": machine_id}).first())
        if resume is not None:  # what its checkpoints are computed from (checks.py)
            conn.execute(update(_JOBS).where(_JOBS.c.id == job_id).values(resume_id=resume.id))
        return Claim(JobView.from_row(row), gpus,
                     CheckpointView.from_row(resume) if resume is not None else None)

    def _gpu_candidate(self, s: Connection, machine_id: str, offer: MachineView,
                       window: int = 64) -> tuple[Any, str, int, tuple[str, ...], int, int] | None:
        """The oldest of the first `window` GPU jobs that fits this machine's GPUs now."""
        reserved = {uuid: int(mb) for uuid, mb in s.execute(
            select(GpuReservation.gpu_uuid, func.sum(GpuReservation.memory_mb))
            .where(GpuReservation.machine_id == machine_id)
            .group_by(GpuReservation.gpu_uuid))}
        view = dataclasses.replace(offer, gpus=tuple(
            dataclasses.replace(g, reserved_mb=reserved.get(g.uuid, 0)) for g in offer.gpus))
        # Not locked: locking the whole window would hide it from every other machine until we
        # commit. The guarded update in claim_next settles races; the machine row lock (taken
        # by the caller on PostgreSQL) keeps two leases from reserving one GPU's memory twice.
        q = (select(Job.id, Job.attempt, Job.created_at, Job.spec_json, Job.shards_total)
             .where(Job.state == _CLAIMABLE.value, Job.gpus_needed > 0, _SUITS_LIMITS,
                   Job.share.is_(None) | Job.share.in_(sorted(offer.shares)))
             .order_by(Job.created_at, Job.id).limit(window))
        for job_id, attempt, created, spec_json, shards in s.execute(q, _room(machine_id, offer)):
            need = stored_spec(spec_json).resources
            chosen = place(need, view)
            if chosen:
                return (created, job_id, attempt, chosen, need.gpu_memory_mb, shards)
        return None

# The claim path's statements, built once. A lease is the move QUEUED -> BUILDING: the
# guarded move of moves.py, precompiled (it is the hot path); its row check is the RETURNING
# row (none: another machine took the job first, so the next candidate is tried).
_JOBS, _CHECKPOINTS = Base.metadata.tables["jobs"], Base.metadata.tables["checkpoints"]
(_CLAIMABLE,) = sources_of(JobState.BUILDING)  # one state, so an equality the index serves
# A job is for a machine only if it needs no limit the machine lacks (bit masks, spec.LIMITS)
# and no more CPUs, memory or disk than one task can be given there (_room).
# Nor a job this machine said it cannot run lately (job_refusals: a base it lacks, say; after
# REFUSAL_TTL_S it is offered again: what it lacked may have been a passing failure).
_REFUSALS = Base.metadata.tables["job_refusals"]
REFUSAL_TTL_S = 3600.0
_REPLICA_MACHINES = Base.metadata.tables["replica_machines"]
_SUITS_LIMITS = ((_JOBS.c.limits_needed.op("&")(bindparam("lacks")) == 0)
                 & (_JOBS.c.cpus_needed <= bindparam("cpus"))
                 & (_JOBS.c.memory_needed_mb <= bindparam("memory_mb"))
                 & (_JOBS.c.disk_needed_mb <= bindparam("disk_mb"))
                 & ~exists().where(_REFUSALS.c.job_id == _JOBS.c.id,
                                   _REFUSALS.c.machine_id == bindparam("machine_id"),
                                   _REFUSALS.c.at > bindparam("refused_since"))
                 # A verified job is never leased (its replicas are), and a machine that took
                 # one of its replicas (or shares an address with one that did) takes no other;
                 # the same for the checks of a checkpoint, and its maker (coordinator/checks.py).
                 & (_JOBS.c.replicas == 0)
                 & ~exists().where(_REPLICA_MACHINES.c.job_id == _JOBS.c.apart,
                                   _REPLICA_MACHINES.c.machine_id == bindparam("machine_id"),
                                   _REPLICA_MACHINES.c.replica_id != _JOBS.c.id))
_DEMAND = (select(_JOBS.c.limits_needed, _JOBS.c.cpus_needed, _JOBS.c.memory_needed_mb,
                  _JOBS.c.disk_needed_mb, _JOBS.c.gpus_needed, _JOBS.c.share, _JOBS.c.shards_total)
           .where(_JOBS.c.state == _CLAIMABLE.value, _JOBS.c.replicas == 0)
           .order_by(_JOBS.c.created_at, _JOBS.c.id).limit(bindparam("rows")))


def queued_demand(db: Database, rows: int) -> Counter[Demand]:
    """What the oldest `rows` claimable jobs need of a machine (scheduler.Demand), and at
    most how many machines can take work of each need (a sharded job's shards each count):
    empty when nothing is queued. One statement, whatever the fleet."""
    needs: Counter[Demand] = Counter()
    with db.read() as s:
        for limits, cpus, memory, disk, gpus, share, shards in s.execute(_DEMAND, {"rows": rows}):
            needs[Demand(limits or 0, cpus or 0.0, memory or 0, disk or 0, gpus or 0, share)] += (
                shards or 1)
    return needs


def _party_of(conn: Connection, job_id: str, pair: str) -> str:
    """Whose work a comparison judges: a verified job's replicas (its id), or a checkpoint's
    maker and checks (checks.group of the job's own checkpoint in the pair)."""
    ids = [int(p[5:]) for p in pair.split(",") if p.startswith("ckpt:")]
    if not ids:
        return job_id
    own = conn.scalar(select(_CHECKPOINTS.c.id).where(_CHECKPOINTS.c.id.in_(ids),
                                                      _CHECKPOINTS.c.job_id == job_id))
    return f"ckpt-{own}"


_UNSAID = 2**31 - 1  # a size the machine did not say (an older agent): no bound


def _room(machine_id: str, offer: MachineView) -> dict[str, Any]:
    """The claim's bounds for this machine: what _SUITS_LIMITS reads (its id for its
    refusals, the limits it lacks, its sizes)."""
    return {"machine_id": machine_id, "lacks": offer.lacks_mask,
            "refused_since": utcnow() - dt.timedelta(seconds=REFUSAL_TTL_S), "cpus": offer.cpus or _UNSAID,
            "memory_mb": offer.memory_mb or _UNSAID, "disk_mb": offer.disk_mb or _UNSAID}
# The fast path takes jobs that need no provider share; those come through _share_candidate.
_NEXT_CPU_JOB = (select(_JOBS.c.id, _JOBS.c.attempt, _JOBS.c.created_at, _JOBS.c.shards_total)
                 .where(_JOBS.c.state == _CLAIMABLE.value, _JOBS.c.gpus_needed == 0,
                        _SUITS_LIMITS, _JOBS.c.share.is_(None))
                 .order_by(_JOBS.c.created_at, _JOBS.c.id).limit(1))
_NEXT_CPU_JOB_PG = _NEXT_CPU_JOB.with_for_update(skip_locked=True)


def _next_share_job(shares: frozenset[str], postgres: bool) -> Any:
    """The oldest queued CPU job that needs one of the folders this machine shares."""
    q = (select(_JOBS.c.id, _JOBS.c.attempt, _JOBS.c.created_at, _JOBS.c.shards_total)
         .where(_JOBS.c.state == _CLAIMABLE.value, _JOBS.c.gpus_needed == 0, _SUITS_LIMITS,
                _JOBS.c.share.in_(sorted(shares)))
         .order_by(_JOBS.c.created_at, _JOBS.c.id).limit(1))
    return q.with_for_update(skip_locked=True) if postgres else q
_LEASE_VALUES = {"state": JobState.BUILDING.value, "attempt": _JOBS.c.attempt + 1,
                 "machine_id": bindparam("machine_id"), "lease_expires_at": bindparam("expires"),
                 "reason": None, "updated_at": bindparam("now"), "resume_id": None}
_TAKE_NEXT, _TAKE_NEXT_PG = (
    update(_JOBS).where(_JOBS.c.id == head.with_only_columns(_JOBS.c.id).scalar_subquery(),
                        _JOBS.c.state == _CLAIMABLE.value, _JOBS.c.shards_total == 0)
    .values(**_LEASE_VALUES).returning(*_JOBS.c)
    for head in (_NEXT_CPU_JOB, _NEXT_CPU_JOB_PG))
_LOCK_MACHINE = (select(Machine.id).where(Machine.id == bindparam("machine_id"))
                 .with_for_update())
_TAKE_JOB = (update(_JOBS)
             .where(_JOBS.c.id == bindparam("job_id"), _JOBS.c.state == _CLAIMABLE.value,
                    _JOBS.c.attempt == bindparam("seen_attempt"))
             .values(**_LEASE_VALUES).returning(*_JOBS.c))
_ADD_EVENT = insert(JobEvent)
# A job resumes from its newest checkpoint that a check agreed with, or that a machine in good
# standing made: not from one a quarantined or revoked machine made (which could be poisoned),
# and never from one a check rejected or could not check, nor one made from those (checks.py
# marks them all).
RESUMABLE = ((_CHECKPOINTS.c.verdict.is_(None) | _CHECKPOINTS.c.verdict.notin_(NOT_RESUMED))
             & ((_CHECKPOINTS.c.verdict == AGREED) | _CHECKPOINTS.c.machine_id.is_(None)
                | _CHECKPOINTS.c.machine_id.in_(select(Machine.id).where(
                    Machine.status == MachineStatus.APPROVED.value))))
_LATEST_CHECKPOINT = (select(*_CHECKPOINTS.c).where(_CHECKPOINTS.c.job_id == bindparam("job_id"),
                                                    RESUMABLE)
                      .order_by(_CHECKPOINTS.c.epoch.desc(), _CHECKPOINTS.c.id.desc()).limit(1))
_CHECK_FROM = select(*_CHECKPOINTS.c).where(_CHECKPOINTS.c.id == bindparam("id"))
_LATEST_OWN_CHECKPOINT = _LATEST_CHECKPOINT.where(
    _CHECKPOINTS.c.machine_id == bindparam("machine_id"))


def _take_next_sqlite(conn: Connection, params: dict[str, Any]) -> SimpleNamespace | None:
    """_TAKE_NEXT on SQLite, on the DBAPI cursor: the same statement (compiled from it once)
    without SQLAlchemy's per-execution work, which was a tenth of a lease's time. Dates are
    converted as the models' UTCDateTime and SQLite's DATETIME do (the store tests run every
    claim through here)."""
    global _SQLITE_TAKE
    if _SQLITE_TAKE is None:
        compiled = _TAKE_NEXT.compile(dialect=conn.dialect)
        order = tuple(compiled.positiontup or ())
        fixed = dict(compiled.construct_params({"machine_id": "", "expires": None, "now": None,
                                                **_room("", MachineView("", ""))}))
        _SQLITE_TAKE = (str(compiled), order, fixed)
    sql, order, fixed = _SQLITE_TAKE
    values = {**fixed, **params}
    cursor = conn.connection.driver_connection.execute(  # type: ignore[union-attr]
        sql, tuple(_sqlite_value(values[name]) for name in order))
    found = cursor.fetchone()
    if found is None:
        return None
    names = [d[0] for d in cursor.description]
    return SimpleNamespace(**{n: _from_sqlite(n, v) for n, v in zip(names, found, strict=True)})


_SQLITE_TAKE: tuple[str, tuple[str, ...], dict[str, Any]] | None = None
_DATETIMES = frozenset(c.name for c in _JOBS.c if isinstance(c.type, UTCDateTime))


def _sqlite_value(v: Any) -> Any:
    if isinstance(v, dt.datetime):  # as UTCDateTime + SQLite DATETIME store it
        return v.astimezone(dt.UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    return v


def _from_sqlite(name: str, v: Any) -> Any:
    if name in _DATETIMES and v is not None:
        return dt.datetime.fromisoformat(v).replace(tzinfo=dt.UTC)
    return v
