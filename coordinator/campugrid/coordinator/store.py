"""The store of plain jobs: one named operation per transition, each a guarded move
(moves.py) with the attempt's own guards; a refused call is recorded in the job's history
and raised as a domain error after the transaction commits. Claiming (claims.py) is correct
on SQLite (guarded update by id and state); SKIP LOCKED is only a speed-up.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from campugrid.coordinator import checks, verified
from campugrid.coordinator.apps import Apps, Nonces
from campugrid.coordinator.checkpoint_records import CheckpointRecords
from campugrid.coordinator.claims import REFUSAL_TTL_S, Claimer, queued_demand
from campugrid.coordinator.db import Database, job_row, side_database
from campugrid.coordinator.fence import attempt_guard, attempt_held, refusal
from campugrid.coordinator.gpu_history import GpuHistories
from campugrid.coordinator.machines import Machines
from campugrid.coordinator.models import (
    MAX_LOG_CHUNK,
    Checkpoint,
    GpuReservation,
    Job,
    JobEvent,
    JobRefusal,
    LogChunk,
    Nonce,
    RateCounter,
    Shard,
    clean,
)
from campugrid.coordinator.moves import kind_of, move_job
from campugrid.coordinator.ratelimits import DatabaseCounters, Limiter
from campugrid.coordinator.scheduler import Demand, MachineView
from campugrid.coordinator.sharding import ShardStore, cancel_shards, insert_shards
from campugrid.coordinator.uploads import Uploads
from campugrid.coordinator.uploads import take as take_uploads
from campugrid.coordinator.views import (
    Claim,
    EventView,
    HoldRef,
    JobView,
    LogView,
    stored_spec,
    utcnow,
)
from campugrid.protocol.errors import (
    Conflict,
    IllegalTransition,
    InvalidInput,
    NotFound,
    StaleAttempt,
)
from campugrid.protocol.spec import JobSpec, limits_mask
from campugrid.protocol.spec import Shard as SpecShard
from campugrid.protocol.states import ACTIVE, JobState


class Store:
    """Plain jobs; `shards`, `checkpoints` and `machines` are the sharded jobs', the
    checkpoints' and the machines' stores,
    on the same database, and claims go through `claim`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.db = Database(engine)
        self.tx, self.read = self.db.tx, self.db.read
        self.shards = ShardStore(self.db)
        self.checkpoints = CheckpointRecords(self.db)
        self.machines = Machines(self.db)
        self.apps = Apps(self.db)
        self.uploads = Uploads(self.db)
        self.gpu_history = GpuHistories(self.db)
        # Every signed call writes a nonce: on SQLite beside the jobs' file, not in its queue.
        self.nonces = Nonces(Database(side_database(engine, "nonces", Nonce.__table__,
                                                    single_statements=True)))
        # Rate limits count in the database too, so they hold across coordinator processes.
        self.counters = DatabaseCounters(Database(side_database(engine, "limits", RateCounter.__table__)))
        self.limiter = Limiter(self.counters)
        self._claims = Claimer(self.db)

    def close(self) -> None:
        self.engine.dispose()
        for side in (self.nonces.db.engine, self.counters.db.engine):
            if side is not self.engine:
                side.dispose()

    # --- researchers ------------------------------------------------------------------------

    def submit(self, spec: JobSpec, context_key: str, context_sha256: str,
               owner: str = "", tickets: Sequence[str] = (),
               bases: dict[str, str] | None = None) -> tuple[JobView, bool]:
        """Store a new job for `owner` (an app id; "" for none), taking its upload `tickets`
        in the same transaction, with the digests its remote `bases` resolved to; with a
        client_job_id the owner used before, return the stored one (created=False)."""
        now = utcnow()
        spec_text = spec.without_shards().to_json()
        row = Job(
            id=str(uuid.uuid4()), owner_id=owner, client_job_id=spec.client_job_id, name=spec.name,
            state=JobState.QUEUED.value, spec_json=spec_text, context_key=context_key,
            context_sha256=context_sha256, attempt=0, max_attempts=spec.max_attempts,
            gpus_needed=spec.resources.gpus, limits_needed=limits_mask(spec.resources.require_limits),
            cpus_needed=spec.resources.cpus, memory_needed_mb=spec.resources.memory_mb,
            disk_needed_mb=spec.resources.disk_needed_mb,
            share=spec.share,
            created_at=now, updated_at=now,
            shards_total=len(spec.shards), shards_queued=len(spec.shards), shards_done=0,
            shards_failed=0, shards_sha256=spec.shards_sha256,
            bases_json=json.dumps(bases, sort_keys=True) if bases else None,
        )
        try:
            with self.tx() as s:
                s.add(row)
                s.flush()
                take_uploads(s, list(tickets), owner, row.id)
                if spec.shards:
                    row.shards_queued = insert_shards(s, row.id, spec)
                s.add(JobEvent(job_id=row.id, at=now, attempt=0, kind="submitted",
                               detail=f"{len(spec.shards)} shards" if spec.shards else ""))
                if spec.verify is not None and spec.verify.replicated and not spec.shards:
                    # (a sharded job's shards are copied instead)
                    verified.make_replicas(s, row, spec.verify.replicas, now)
            return JobView.from_row(row), True
        except IntegrityError:
            if spec.client_job_id is None:
                raise
        with self.tx() as s:
            existing = s.scalars(select(Job).where(Job.client_job_id == spec.client_job_id,
                                                   Job.owner_id == owner)).one()
            if (existing.spec_json != spec_text or existing.context_sha256 != context_sha256
                    or existing.shards_sha256 != spec.shards_sha256):
                raise Conflict(
                    f"client_job_id {spec.client_job_id!r} is already job {existing.id} with a "
                    "different spec or context; use a new client_job_id for a new job")
            return JobView.from_row(existing), False

    def note(self, job_id: str, attempt: int, kind: str, detail: str) -> None:
        """A line in the job's history that changes nothing else (e.g. how its inputs move)."""
        with self.tx() as s:
            s.add(JobEvent(job_id=job_id, at=utcnow(), attempt=attempt, kind=kind,
                           detail=detail[:4000]))

    def job_id(self, ref: str, owner: str | None = None) -> str:
        """The id of the job `ref` names: its id, or (as the CLI and console show them) any
        start of it that is one job's alone, among `owner`'s jobs when given. NotFound, or
        InvalidInput for a start several jobs share."""
        ref = ref.strip().lower()
        try:
            return str(uuid.UUID(ref))
        except ValueError:
            pass
        if not _ID_START.fullmatch(ref):
            raise NotFound(f"no job {ref[:64]!r} (a job id is a UUID, or its first characters: "
                           f"at least {_ID_START_MIN})")
        # A range the primary key serves, then the exact test (collations may order '-' apart).
        q = select(Job.id).where(Job.id >= ref, Job.id < ref + "g").order_by(Job.id).limit(50)
        if owner is not None:
            q = q.where(Job.owner_id == owner)
        with self.read() as s:
            found = [i for i in s.scalars(q) if i.startswith(ref)][:2]
        if not found:
            raise NotFound(f"no job whose id starts with {ref!r}")
        if len(found) > 1:
            raise InvalidInput(f"{ref!r} starts the ids of several jobs ({found[0]}, "
                               f"{found[1]}, …): give more of it")
        return found[0]

    def refuse(self, job_id: str, machine_id: str, reason: str) -> None:
        """This machine cannot run this job: it is not offered it again for REFUSAL_TTL_S."""
        with self.tx() as s:
            _refuse(s, job_id, machine_id, reason, utcnow())

    def refusals(self, job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """job id -> machine id -> why that machine cannot run it (CannotRunHere), for the
        refusals still in force (REFUSAL_TTL_S)."""
        out: dict[str, dict[str, str]] = {}
        if not job_ids:
            return out
        since = utcnow() - dt.timedelta(seconds=REFUSAL_TTL_S)
        with self.read() as s:
            for r in s.scalars(select(JobRefusal).where(JobRefusal.job_id.in_(job_ids),
                                                        JobRefusal.at > since)):
                out.setdefault(r.job_id, {})[r.machine_id] = r.reason
        return out

    def get(self, job_id: str, owner: str | None = None) -> JobView:
        """The job; with `owner`, only if that app submitted it (else NotFound, as for a job
        that does not exist: another app's ids are not confirmed)."""
        with self.read() as s:
            return JobView.from_row(_owned(job_row(s, job_id), owner))

    def list_jobs(self, state: JobState | None = None, limit: int = 100,
                  owner: str | None = None) -> list[JobView]:
        q = (select(Job).where(Job.replica_of.is_(None),  # replicas, checks and comparisons
                               Job.check_of.is_(None), Job.compare_of.is_(None))  # show on
             # their job
             .order_by(Job.created_at.desc(), Job.id).limit(limit))
        if owner is not None:
            q = q.where(Job.owner_id == owner)
        if state is not None:
            q = q.where(Job.state == state.value)
        with self.read() as s:
            return [JobView.from_row(r) for r in s.scalars(q)]

    def events(self, job_id: str) -> list[EventView]:
        with self.read() as s:
            job_row(s, job_id)
            rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
            return [EventView(r.at, r.attempt, r.kind, r.detail) for r in rows]

    def cancel(self, job_id: str, owner: str | None = None) -> JobView:
        with self.tx() as s:
            row = _owned(job_row(s, job_id), owner)
            if JobState(row.state).final:
                raise IllegalTransition(f"job {job_id} is already {row.state}")
            if row.replica_of or row.check_of is not None or row.compare_of:
                raise InvalidInput(f"job {job_id} checks the job {self._checked_job(s, row)}: "
                                   "cancel that job instead")
            family = [row] + (list(s.scalars(select(Job).where(Job.replica_of == row.id)))
                              if row.replicas else [])
            family += list(s.scalars(select(Job).where(  # comparisons of their answers
                Job.compare_of.in_([one.id for one in family]),
                Job.state.in_([x.value for x in JobState if not x.final]))))
            family += list(s.scalars(select(Job).where(  # checks of their checkpoints
                Job.check_of.in_(select(Checkpoint.id).where(
                    Checkpoint.job_id.in_([one.id for one in family])).scalar_subquery()),
                Job.state.in_([x.value for x in JobState if not x.final]))))
            for one in family:
                if one is not row and JobState(one.state).final:
                    continue
                move_job(s, one.id, JobState.CANCELLED, kind=kind_of(one),
                         where=[Job.attempt == one.attempt], reason="cancelled by the user",
                         machine_id=None, lease_expires_at=None)
                s.add(JobEvent(job_id=one.id, at=utcnow(), attempt=one.attempt,
                               kind="cancelled", detail=f"was {one.state}"))
                self._free_gpus(s, one.id)
            if row.shards_total:
                cancel_shards(s, job_id, "the job was cancelled")
            s.refresh(row)
            return JobView.from_row(row)

    def logs(self, job_id: str, *, after_id: int = 0, stream: str | None = None,
             limit: int = 10_000) -> list[LogView]:
        q = (select(LogChunk).where(LogChunk.job_id == job_id, LogChunk.id > after_id)
             .order_by(LogChunk.id).limit(limit))
        if stream is not None:
            q = q.where(LogChunk.stream == stream)
        with self.read() as s:
            job_row(s, job_id)
            return [LogView(r.id, r.attempt, r.stream, r.text) for r in s.scalars(q)]

    def log_tail(self, job_id: str, limit: int = 2000) -> list[LogView]:
        """The job's last `limit` log chunks, oldest first."""
        q = (select(LogChunk).where(LogChunk.job_id == job_id)
             .order_by(LogChunk.id.desc()).limit(limit))
        with self.read() as s:
            job_row(s, job_id)
            return [LogView(r.id, r.attempt, r.stream, r.text) for r in s.scalars(q)][::-1]

    # --- agents ---------------------------------------------------------------------------

    def claim_next(self, machine_id: str, lease_s: float,
                   machine: MachineView | None = None) -> JobView | None:
        claim = self.claim(machine_id, lease_s, machine)
        return claim.job if claim is not None else None

    def claim(self, machine_id: str, lease_s: float,
              machine: MachineView | None = None, *, heavy_first: bool = True) -> Claim | None:
        """Lease the oldest queued job this machine can hold (see campugrid.coordinator.claims)."""
        return self._claims.claim(machine_id, lease_s, machine, heavy_first=heavy_first)

    def queued_demand(self, rows: int) -> Counter[Demand]:
        """What the oldest `rows` claimable jobs need of a machine, and at most how many
        machines can take work of each need."""
        return queued_demand(self.db, rows)

    def reserved_gpus(self, job_id: str, attempt: int) -> list[str]:
        with self.read() as s:
            return list(s.scalars(select(GpuReservation.gpu_uuid).where(
                GpuReservation.job_id == job_id, GpuReservation.attempt == attempt)
                .order_by(GpuReservation.id)))

    # --- an attempt's hold (holds.py offers these as its verbs; fence.py is the fence) -----

    def renew_lease(self, ref: HoldRef, phase: JobState, lease_s: float) -> JobView:
        """Extend the lease of the current attempt; also moves BUILDING -> RUNNING."""
        assert phase in ACTIVE
        job_id, token = ref.job_id, ref.token
        now = utcnow()
        refused: StaleAttempt | IllegalTransition | None = None
        with self.tx() as s:
            try:  # BUILDING -> RUNNING, or the same phase again with a longer lease
                move_job(s, job_id, phase, stay=True, within=ACTIVE, where=attempt_guard(ref),
                         lease_expires_at=now + dt.timedelta(seconds=lease_s), updated_at=now)
            except IllegalTransition:
                row = job_row(s, job_id)
                if (phase is JobState.BUILDING and row.state == JobState.RUNNING.value
                        and attempt_held(row, ref)):
                    # Sent while it built, come after it started (retried through another
                    # coordinator): the lease is still its own, so it is renewed as running.
                    move_job(s, job_id, JobState.RUNNING, stay=True, within=ACTIVE,
                             where=attempt_guard(ref), updated_at=now,
                             lease_expires_at=now + dt.timedelta(seconds=lease_s))
                else:
                    # A renewal that crossed its own attempt's last call is no one's concern:
                    # it is refused without a line in the job's history.
                    ended = row.attempt == token and row.state not in {x.value for x in ACTIVE}
                    refused = refusal(s, row, token, "renew", record=not ended)
            row = job_row(s, job_id)
        if refused is not None:
            raise refused
        return JobView.from_row(row)

    def append_logs(self, ref: HoldRef, stream: str, seq: int, text: str) -> None:
        job_id, token = ref.job_id, ref.token
        try:
            with self.tx() as s:
                row = job_row(s, job_id)
                if not attempt_held(row, ref):
                    refused = refusal(s, row, token, "logs")
                else:
                    refused = None
                    exists = s.scalar(select(LogChunk.id).where(
                        LogChunk.job_id == job_id, LogChunk.attempt == token,
                        LogChunk.stream == stream, LogChunk.seq == seq))
                    if exists is None:  # a retried chunk is stored once
                        s.add(LogChunk(job_id=job_id, attempt=token, stream=stream, seq=seq,
                                       text=(clean(text) or "")[:MAX_LOG_CHUNK]))
        except IntegrityError:
            return  # the same chunk, retried concurrently: already stored
        if refused is not None:
            raise refused

    def finish(self, ref: HoldRef, *, succeeded: bool, exit_code: int | None,
               reason: str | None, result: str | None, output_key: str | None,
               limits: dict[str, str], output_files: Sequence[tuple[str, int]] = (),
               output_digest: str | None = None) -> JobView:
        """The attempt's end; for a replica of a verified job, with the digest of its output
        as the coordinator read it (quorum.output_digest), and its job decided on if it can
        be (verified.settle)."""
        job_id, token = ref.job_id, ref.token
        target = JobState.SUCCEEDED if succeeded else JobState.FAILED
        refused: StaleAttempt | IllegalTransition | None = None
        with self.tx() as s:
            verified.lock_parent(s, job_id)
            try:
                move_job(s, job_id, target, within=ACTIVE, where=attempt_guard(ref),
                         exit_code=exit_code, reason=clean(reason), result=clean(result),
                         output_key=output_key, limits_json=json.dumps(limits),
                         output_files_json=json.dumps([list(f) for f in output_files])
                         if output_key and output_files else None,
                         output_digest=output_digest, lease_expires_at=None)
            except IllegalTransition:
                refused = refusal(s, job_row(s, job_id), token, "complete")
            else:
                s.add(JobEvent(job_id=job_id, at=utcnow(), attempt=token, kind=target.value,
                               detail=clean(reason) or ""))
                self._free_gpus(s, job_id)
                self._ended(s, job_id)
            row = job_row(s, job_id)
        if refused is not None:
            raise refused
        return JobView.from_row(row)

    def requeue_expired(self, now: dt.datetime | None = None) -> list[str]:
        """Jobs whose lease ran out go back to the queue, or fail when out of attempts."""
        now = now or utcnow()
        moved: list[str] = []
        with self.tx() as s:
            expired: Sequence[Any] = s.execute(
                select(Job.id, Job.attempt, Job.max_attempts, Job.machine_id, Job.drained)
                .where(Job.state.in_([x.value for x in ACTIVE]), Job.lease_expires_at < now,
                       Job.shards_total == 0, Job.replicas == 0)
            ).all()
            for job_id, attempt, max_attempts, machine_id, drained in expired:
                verified.lock_parent(s, job_id)
                out_of_attempts = attempt - drained >= max_attempts
                target = JobState.FAILED if out_of_attempts else JobState.QUEUED
                reason = (f"lease of attempt {attempt} on machine {machine_id} expired"
                          + (f"; all {max_attempts} attempts used" if out_of_attempts else ""))
                try:  # unless it was renewed or finished since the read
                    move_job(s, job_id, target, within=ACTIVE,
                             where=[Job.attempt == attempt, Job.lease_expires_at < now],
                             machine_id=None, lease_expires_at=None, reason=reason,
                             updated_at=now)
                except IllegalTransition:
                    continue
                s.add(JobEvent(job_id=job_id, at=now, attempt=attempt,
                               kind="lease_expired", detail=reason))
                self._free_gpus(s, job_id)
                if out_of_attempts:
                    self._ended(s, job_id)
                moved.append(job_id)
        return moved + self.shards.requeue_expired(now)

    def check_attempt(self, ref: HoldRef, what: str) -> JobView:
        """The job, if `ref` is its current attempt, held by this machine; else refused."""
        with self.tx() as s:
            row = job_row(s, ref.job_id)
            refused = None if attempt_held(row, ref) else refusal(s, row, ref.token, what)
        if refused is not None:
            raise refused
        return JobView.from_row(row)

    def release(self, ref: HoldRef, reason: str, failed: bool = False,
                cannot_run_here: bool = False) -> JobView:
        """The attempt goes back to the queue: a drain does not count against max_attempts;
        a provider-side failure (`failed`) does, and fails the job when none are left; a
        machine that cannot run the job (`cannot_run_here`) does not, and is never offered
        it again."""
        job_id, token, machine_id = ref.job_id, ref.token, ref.machine_id
        now = utcnow()
        failed = failed and not cannot_run_here
        with self.tx() as s:
            verified.lock_parent(s, job_id)
            row = job_row(s, job_id)
            used = row.attempt - row.drained
            exhausted = failed and used >= row.max_attempts
            target = JobState.FAILED if exhausted else JobState.QUEUED
            why = (f"attempt {token} failed on its machine: {reason}" if failed
                   else f"its machine cannot run it: {reason}" if cannot_run_here
                   else f"drained: {reason}")
            if exhausted:
                why += f"; all {row.max_attempts} attempts used"
            refused: StaleAttempt | IllegalTransition | None = None
            try:
                move_job(s, job_id, target, within=ACTIVE, where=attempt_guard(ref),
                         drained=Job.drained + (0 if failed else 1), machine_id=None,
                         lease_expires_at=None, reason=clean(why), updated_at=now)
            except IllegalTransition:
                refused = refusal(s, row, token, "release")
            else:
                s.add(JobEvent(job_id=job_id, at=now, attempt=token,
                               kind="handed_back" if failed or cannot_run_here else "drained",
                               detail=clean(why if cannot_run_here else reason)))
                if cannot_run_here:
                    _refuse(s, job_id, machine_id, reason, now)
                self._free_gpus(s, job_id)
                if exhausted:
                    self._ended(s, job_id)
            row = job_row(s, job_id)
        if refused is not None:
            raise refused
        return JobView.from_row(row)

    def extend_active_leases(self, lease_s: float) -> int:
        """After a coordinator restart, give agents one lease period to reach us again."""
        with self.tx() as s:
            res = s.execute(update(Job).where(Job.state.in_([x.value for x in ACTIVE]),
                                              Job.shards_total == 0, Job.replicas == 0)
                            .values(lease_expires_at=utcnow() + dt.timedelta(seconds=lease_s)))
            jobs = int(res.rowcount)  # type: ignore[attr-defined]
        return jobs + self.shards.extend_active(lease_s)

    def replicas(self, job_id: str) -> list[JobView]:
        """The replicas of a verified job, those that ended first, in the order they did."""
        with self.read() as s:
            rows = list(s.scalars(select(Job).where(Job.replica_of == job_id)
                                  .order_by(Job.updated_at, Job.id)))
        return [JobView.from_row(r) for r in sorted(rows, key=lambda r: not JobState(r.state).final)]

    def rerun(self, job_id: str, owner: str | None = None) -> JobView:
        """A new job with the same spec, context and bases as this one (with its shards), for
        a result that cannot be trusted (tainted) or simply again; its owner is the same."""
        with self.read() as s:
            row = _owned(job_row(s, job_id), owner)
            shards = list(s.scalars(select(Shard).where(Shard.job_id == job_id,
                                                        Shard.copy_of.is_(None))
                                    .order_by(Shard.idx))) if row.shards_total else []
        if row.replica_of or row.check_of is not None or row.compare_of:
            with self.read() as s:
                raise InvalidInput(f"job {job_id} checks the job {self._checked_job(s, row)}: "
                                   "run that job again instead")
        spec = stored_spec(row.spec_json)
        if any(ds.ticket for ds in spec.datasets):
            raise InvalidInput(f"job {job_id} read uploaded files, which were deleted when it "
                               "ended: submit it again with the files (`submit --upload`)")
        spec = dataclasses.replace(spec, client_job_id=None, shards=tuple(
            SpecShard(payload_json=sh.payload_json, cost=sh.cost) for sh in shards))
        new, _ = self.submit(spec, row.context_key, row.context_sha256, row.owner_id or "",
                             bases=json.loads(row.bases_json) if row.bases_json else None)
        self.note(new.id, 0, "rerun", f"a new run of job {row.id}")
        self.note(row.id, row.attempt, "rerun", f"run again as job {new.id}")
        return new

    def judged(self, job_id: str) -> dict[frozenset[str], bool | None]:
        """What the compare command of a verified job said of pairs of its replicas."""
        with self.read() as s:
            return verified.verdicts_of(list(s.scalars(select(Job).where(
                Job.compare_of == job_id))))

    def part_of(self, job_id: str) -> tuple[bool, bool]:
        """(Is this job a replica, is it a replica, a check or a comparison): is its output
        compared, and may its end decide something?"""
        with self.read() as s:
            row = s.execute(select(Job.replica_of, Job.check_of, Job.compare_of)
                            .where(Job.id == job_id)).first()
        return (row is not None and row[0] is not None,
                row is not None and any(v is not None for v in row))

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _ended(s: Session, job_id: str) -> None:
        """A job ended: if it is a replica, its verified job is decided on, if it can be; if it
        is a check, the checkpoint it checks."""
        row = job_row(s, job_id)
        compared = [int(p[5:]) for p in (row.compare_pair or "").split(",")
                    if p.startswith("ckpt:")]
        if compared:  # a comparison of a check's answer: the checked one is the job's own
            checked = s.scalars(select(Checkpoint).where(Checkpoint.id.in_(compared),
                                                         Checkpoint.job_id == row.compare_of)).first()
            if checked is not None:
                checks.settle(s, checked, utcnow())
        elif (parent := row.replica_of or row.compare_of) is not None:
            verified.settle(s, parent, utcnow())
        if row.check_of is not None and (target := s.get(Checkpoint, row.check_of)) is not None:
            checks.settle(s, target, utcnow())
        elif JobState(row.state).final:
            verified.cancel_queued_checks(s, job_id, utcnow())

    @staticmethod
    def _checked_job(s: Session, row: Job) -> str:
        """The job a replica or a check is part of."""
        if row.replica_of is not None:
            return f"{row.replica_of} (it is a replica)"
        if row.compare_of is not None:
            return f"{row.compare_of} (it compares two of its replicas)"
        subject = checks.subject_of(s, row.check_of) if row.check_of is not None else None
        return f"{subject or '?'} (it recomputes one of its checkpoints)"

    @staticmethod
    def _free_gpus(s: Session, job_id: str) -> None:
        """A job holds reservations only while an attempt is active: drop them all."""
        s.execute(delete(GpuReservation).where(GpuReservation.job_id == job_id))



def _refuse(s: Session, job_id: str, machine_id: str, reason: str, now: dt.datetime) -> None:
    s.merge(JobRefusal(job_id=job_id, machine_id=machine_id, at=now, reason=clean(reason)))


_ID_START_MIN = 4
_ID_START = re.compile(rf"[0-9a-f][0-9a-f-]{{{_ID_START_MIN - 1},35}}")


def _owned(row: Job, owner: str | None) -> Job:
    if owner is not None and row.owner_id != owner:
        raise NotFound(f"no job {row.id}")
    return row

