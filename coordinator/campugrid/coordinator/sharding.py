"""Sharded jobs: one task per shard, handed out through sessions.

A session is one machine working through shards of one job in one warm sandbox: the lease
that opens it carries the first shard, and each result the machine reports comes back with
the next one. The session is a hold of kind SESSION (holds.py), its id the fencing token of
every call about it, so a lost machine's late results are refused like a lost attempt's.

The job row keeps counters (total, queued, done, failed) that every change updates first,
which also serialises changes to one job; `_settle` then derives the job's state from them:
QUEUED while shards wait for a machine, RUNNING once every shard is handed out, and
SUCCEEDED or FAILED when every shard has ended.

A verified sharded job (spec.verify) runs each shard as copies on different machines: its rows
0..total-1 are the shards as researchers see them and are never handed out; copies (rows from
total on, `copy_of` naming their shard) are, under the shard's own index, and when one ends
quorum.decide settles its shard as it settles a verified job (verified.judge then quarantines
a machine that answered against a quorum). The job's counters then count copies waiting
(queued) and shards decided (done, failed).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, exists, func, insert, select, update
from sqlalchemy.orm import Session, aliased

from campugrid.coordinator import verified
from campugrid.coordinator.db import Database, job_row
from campugrid.coordinator.fence import session_row
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.models import (
    MAX_LOG_CHUNK,
    GpuReservation,
    Job,
    JobEvent,
    JobRefusal,
    LogChunk,
    Machine,
    Shard,
    ShardSession,
    clean,
)
from campugrid.coordinator.moves import move_job, move_shards
from campugrid.coordinator.quorum import Answer, answer_key, decide
from campugrid.coordinator.views import HoldRef, ShardResult, ShardTask, ShardView, stored_spec
from campugrid.protocol.errors import IllegalTransition, StaleAttempt
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobKind, JobState, ShardState
from campugrid.protocol.verify import Verify


def insert_shards(s: Session, job_id: str, spec: JobSpec) -> int:
    """The job's shards (and for a verified job, their first copies); how many rows wait
    to be handed out."""
    s.execute(insert(Shard), [
        {"job_id": job_id, "idx": i, "state": ShardState.QUEUED.value, "cost": sh.cost,
         "payload_json": sh.payload_json, "tries": 0}
        for i, sh in enumerate(spec.shards)])
    if spec.verify is None:
        return len(spec.shards)
    n, copies = len(spec.shards), spec.verify.replicas
    s.execute(insert(Shard), [
        {"job_id": job_id, "idx": n + i * copies + c, "state": ShardState.QUEUED.value,
         "cost": sh.cost, "payload_json": sh.payload_json, "tries": 0, "copy_of": i}
        for i, sh in enumerate(spec.shards) for c in range(copies)])
    return n * copies


def open_session(s: Session, job_id: str, machine_id: str, lease_s: float, *,
                 heavy_first: bool, gpus: Sequence[str], gpu_mb: int,
                 now: dt.datetime) -> tuple[int, ShardTask] | None:
    """Inside the caller's claim transaction: a new session on `job_id` holding its next
    shard, or None if another machine took the last queued shard first."""
    if not _take_one(s, job_id):
        return None
    sid = int(s.scalars(insert(ShardSession).values(
        job_id=job_id, machine_id=machine_id, active=True, lost=False,
        lease_expires_at=now + dt.timedelta(seconds=lease_s), started_at=now)
        .returning(ShardSession.id)).one())
    task = _hand_out(s, job_id, sid, machine_id, heavy_first)
    if task is None:  # every copy waiting is of a shard this machine answered already
        s.execute(delete(ShardSession).where(ShardSession.id == sid))
        s.merge(JobRefusal(job_id=job_id, machine_id=machine_id, at=now, reason=RAN_EVERY_COPY))
        return None
    for uuid in gpus:
        s.add(GpuReservation(job_id=job_id, attempt=sid, machine_id=machine_id, gpu_uuid=uuid,
                             memory_mb=gpu_mb))
    s.add(JobEvent(job_id=job_id, at=now, attempt=sid, kind="session",
                   detail=f"machine {machine_id} opened session {sid}"
                          + (f", GPUs {', '.join(gpus)}" if gpus else "")))
    _settle(s, job_id)
    return sid, task


# Why a machine was not offered a verified sweep: until a copy waits again (more copies made,
# or one handed back), which may be of a shard it did not answer (_copies_wait_again).
RAN_EVERY_COPY = "it ran another copy of every shard still waiting"


def _copies_wait_again(s: Session, job_id: str) -> None:
    s.execute(delete(JobRefusal).where(JobRefusal.job_id == job_id,
                                       JobRefusal.reason == RAN_EVERY_COPY))


def _take_one(s: Session, job_id: str) -> bool:
    """Count one queued shard of the job as handed out (locks the job row on PostgreSQL)."""
    res = s.execute(update(Job).where(
        Job.id == job_id, Job.shards_queued > 0,
        Job.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]))
        .values(shards_queued=Job.shards_queued - 1, updated_at=dt.datetime.now(dt.UTC))
        .execution_options(synchronize_session=False))
    return bool(res.rowcount == 1)  # type: ignore[attr-defined]


def _hand_out(s: Session, job_id: str, sid: int, machine_id: str,
              heavy_first: bool) -> ShardTask | None:
    """The heaviest queued shard for a fast machine, the lightest for a slow one; for a
    verified job, a copy of a shard this machine has not answered (None: there is none, and
    the one _take_one counted is given back)."""
    # One direction per order, so ix_shards_pick serves both without sorting (forwards for
    # the lightest, backwards for the heaviest): cheap at 100,000 shards too.
    order = (Shard.cost.desc(), Shard.idx.desc()) if heavy_first else (Shard.cost, Shard.idx)
    q = (select(Shard.idx, Shard.payload_json, Shard.cost, Shard.copy_of)
         .where(Shard.job_id == job_id, Shard.state == ShardState.QUEUED.value)
         .order_by(*order).limit(1))
    if _verify_of(s, job_id) is not None:
        # Never two copies of a shard on one machine, nor on two behind one address or of one
        # owner.
        host = verified.one_party(s, machine_id)
        other = aliased(Shard)
        q = q.where(Shard.copy_of.is_not(None), ~exists().where(
            other.job_id == job_id, other.copy_of == Shard.copy_of,
            other.machine_id.in_(sorted(host))))
    found = s.execute(q).first()
    if found is None:
        s.execute(update(Job).where(Job.id == job_id)
                  .values(shards_queued=Job.shards_queued + 1)
                  .execution_options(synchronize_session=False))
        return None
    idx, payload, cost, copy_of = found
    move_shards(s, job_id, ShardState.RUNNING, where=[Shard.idx == idx], session_id=sid,
                machine_id=machine_id)
    if copy_of is not None:  # its shard runs from its first copy on, until it is decided
        move_shards(s, job_id, ShardState.RUNNING, expect=None, where=[
            Shard.idx == copy_of, Shard.state == ShardState.QUEUED.value])
    # A copy runs as its shard: the job sees (and the machine reports) the shard's index.
    return ShardTask(int(idx if copy_of is None else copy_of), str(payload), float(cost))


def _verify_of(s: Session, job_id: str) -> Verify | None:
    return stored_spec(s.scalar(select(Job.spec_json).where(Job.id == job_id)) or "{}").verify


def _decide(s: Session, job_id: str, shard: int, verify: Verify, now: dt.datetime,
            just_ended: int | None = None) -> None:
    """A copy of `shard` ended (row `just_ended`, if it answered): quorum.decide on its
    copies' answers, as verified.settle does for a verified job's replicas."""
    row = s.get(Shard, (job_id, shard), populate_existing=True)
    assert row is not None
    copies = list(s.scalars(select(Shard).where(Shard.job_id == job_id, Shard.copy_of == shard)
                            .order_by(Shard.finished_at, Shard.idx)
                            .execution_options(populate_existing=True)))
    ended = [c for c in copies if ShardState(c.state) not in (ShardState.QUEUED, ShardState.RUNNING)]
    answers = [Answer(str(c.idx), c.machine_id or "", _answer(c)) for c in ended]
    if row.state not in (ShardState.QUEUED.value, ShardState.RUNNING.value):
        # decided already: a late answer is still judged against the answer taken
        taken = _answer(row)
        for a in answers:
            if taken is None or a.key is None or a.replica != str(just_ended):
                continue
            if a.key == taken:
                verified.agreed(s, [a.machine_id], now)
            else:
                verified.quarantine(s, a.machine_id, now, f"on shard {shard} of job {job_id} it "
                                    f"answered {a.says()}, where a quorum had agreed on "
                                    f"{Answer('', '', taken).says()}")
        return
    streak = {m.id: m.streak for m in s.scalars(select(Machine).where(
        Machine.id.in_(sorted({a.machine_id for a in answers if a.machine_id}))))}
    decision = decide(verify, answers, pending=len(copies) - len(ended), made=len(copies),
                      streak=streak, draw=verified.draw())
    if decision.more:
        top = int(s.scalar(select(func.max(Shard.idx)).where(Shard.job_id == job_id)) or 0)
        s.execute(insert(Shard), [
            {"job_id": job_id, "idx": top + 1 + i, "state": ShardState.QUEUED.value,
             "cost": row.cost, "payload_json": row.payload_json, "tries": 0, "copy_of": shard}
            for i in range(decision.more)])
        s.execute(update(Job).where(Job.id == job_id).values(
            shards_queued=Job.shards_queued + decision.more))
        _copies_wait_again(s, job_id)
        s.add(JobEvent(job_id=job_id, at=now, attempt=0, kind="replicated", detail=(
            f"shard {shard}: {decision.more} more cop(ies): " + "; ".join(
                f"machine {a.machine_id[:8]}: {a.says()}" for a in answers))[:4000]))
        return
    if not decision.fail and not decision.accept:
        return  # the copies still running may yet agree
    if decision.fail:
        move_shards(s, job_id, ShardState.FAILED, where=[Shard.idx == shard],
                    reason=decision.fail[:4000], finished_at=now)
        failed = 1
    else:
        first = next(c for c in copies if str(c.idx) == decision.accept[0].replica)
        move_shards(s, job_id, ShardState(first.state), where=[Shard.idx == shard],
                    exit_code=first.exit_code, result_json=first.result_json,
                    reason=first.reason, machine_id=first.machine_id, finished_at=now)
        failed = int(first.state == ShardState.FAILED.value)
        verified.judge(s, decision, now, f"shard {shard} of job {job_id}")
    waiting = move_shards(s, job_id, ShardState.CANCELLED, expect=None, where=[
        Shard.copy_of == shard, Shard.state == ShardState.QUEUED.value],
        reason="not needed: its shard was decided")
    s.execute(update(Job).where(Job.id == job_id).values(
        shards_done=Job.shards_done + 1, shards_failed=Job.shards_failed + failed,
        shards_queued=Job.shards_queued - waiting))


def _shown(copy: Shard, shard: Shard) -> tuple[str | None, Any, bool | None]:
    """A copy as its shard's listing shows it: machine, result, and whether it agreed."""
    taken, said = _answer(shard), _answer(copy)
    return (copy.machine_id, json.loads(copy.result_json) if copy.result_json else None,
            None if taken is None or said is None else said == taken)


def _answer(row: Shard) -> tuple[int | None, str, str] | None:
    return answer_key(row.state, row.exit_code, row.result_json, None)


def cancel_shards(s: Session, job_id: str, why: str) -> None:
    """The job has ended: shards not yet ended never will, and no session goes on."""
    move_shards(s, job_id, ShardState.CANCELLED, expect=None, reason=why)
    s.execute(update(ShardSession).where(ShardSession.job_id == job_id).values(active=False))


def _settle(s: Session, job_id: str) -> None:
    """Derive the job's state from its counters (read after this transaction's updates)."""
    job = s.execute(select(Job.state, Job.shards_total, Job.shards_queued, Job.shards_done,
                           Job.shards_failed).where(Job.id == job_id)).one()
    state, total, queued, done, failed = job
    state = JobState(state)
    if state.final:
        return
    now = dt.datetime.now(dt.UTC)
    if done >= total:
        target = JobState.FAILED if failed else JobState.SUCCEEDED
        reason = None
        if failed:
            first = s.execute(select(Shard.idx, Shard.reason).where(
                Shard.job_id == job_id, Shard.state == ShardState.FAILED.value)
                .order_by(Shard.idx).limit(1)).one()
            reason = (f"{failed} of {total} shards failed (first: shard {first[0]}: {first[1]}); "
                      "every shard's result: campugrid shards JOB_ID")
        move_job(s, job_id, target, kind=JobKind.SHARDED, within={state}, reason=reason,
                 result=f"{total - failed} of {total} shards succeeded", exit_code=None,
                 updated_at=now)
        s.execute(update(ShardSession).where(ShardSession.job_id == job_id,
                                             ShardSession.active.is_(True)).values(active=False))
        s.execute(delete(GpuReservation).where(GpuReservation.job_id == job_id))
        s.add(JobEvent(job_id=job_id, at=now, attempt=0, kind=target.value,
                       detail=reason or f"all {total} shards succeeded"))
        return
    target = JobState.QUEUED if queued > 0 else JobState.RUNNING
    if target != state:
        move_job(s, job_id, target, kind=JobKind.SHARDED, within={state}, updated_at=now)


class ShardStore:
    """The shard operations; each is one transaction of the job store."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # --- a session's hold (holds.py offers these as its verbs; fence.py is the fence) -----

    def next_shard(self, ref: HoldRef, done: ShardResult | None, *,
                   heavy_first: bool) -> ShardTask | None:
        """Record the result of the shard the session holds and hand out the next one
        (None: no shard is waiting, or the job has ended)."""
        job_id, machine_id = ref.job_id, ref.machine_id
        with self.db.tx() as s:
            session = session_row(s, ref, "shard result")
            if done is not None:
                self._record(s, job_id, session.id, done)
                if _verify_of(s, job_id) is not None and s.scalar(select(Machine.status).where(
                        Machine.id == machine_id)) != MachineStatus.APPROVED.value:
                    return None  # this very result got its machine quarantined
            state = JobState(s.scalar(select(Job.state).where(Job.id == job_id)) or "failed")
            if state.final or not _take_one(s, job_id):
                return None
            task = _hand_out(s, job_id, session.id, machine_id, heavy_first)
            _settle(s, job_id)
            return task

    def _record(self, s: Session, job_id: str, sid: int, done: ShardResult) -> None:
        verify = _verify_of(s, job_id)
        if verify is not None:  # the job row first: one shard's copies are decided in turn
            s.execute(update(Job).where(Job.id == job_id).values(updated_at=Job.updated_at)
                      .execution_options(synchronize_session=False))
        # A verified job's session holds a copy of the shard it names (one per shard at most).
        which = (Shard.idx == done.index) if verify is None else (Shard.copy_of == done.index)
        now = dt.datetime.now(dt.UTC)
        move_shards(
            s, job_id, ShardState.SUCCEEDED if done.succeeded else ShardState.FAILED,
            where=[which, Shard.session_id == sid, Shard.state == ShardState.RUNNING.value],
            refused=lambda: StaleAttempt(f"result of shard {done.index} refused: session {sid} "
                                         "does not hold it"),
            exit_code=done.exit_code, result_json=clean(done.result_json),
            reason=clean(done.reason), finished_at=now)
        if verify is not None:
            copy = s.scalar(select(Shard.idx).where(Shard.job_id == job_id, which,
                                                    Shard.session_id == sid))
            _decide(s, job_id, done.index, verify, now, just_ended=copy)
        else:
            s.execute(update(Job).where(Job.id == job_id).values(
                shards_done=Job.shards_done + 1,
                shards_failed=Job.shards_failed + (0 if done.succeeded else 1)))
        _settle(s, job_id)

    def renew(self, ref: HoldRef, lease_s: float) -> None:
        now = dt.datetime.now(dt.UTC)
        with self.db.tx() as s:
            session = session_row(s, ref, "renew")
            state = JobState(s.scalar(select(Job.state).where(Job.id == ref.job_id)) or "failed")
            if state.final:
                session.active = False
                refused = IllegalTransition(f"renew of session {session.id} refused: the job "
                                            f"is {state.value}")
            else:
                session.lease_expires_at = now + dt.timedelta(seconds=lease_s)
                refused = None
        if refused is not None:
            raise refused

    def end(self, ref: HoldRef, *, failure: str | None) -> None:
        """The machine is done with the session. `failure` is the job's own fault (its image
        does not build, the shard runner cannot start): the whole job fails with it."""
        job_id = ref.job_id
        with self.db.tx() as s:
            session = session_row(s, ref, "end of session", ended_ok=failure is None)
            if not session.active:  # the job ended first, which closed it
                return
            if failure and _verify_of(s, job_id) is not None:
                # One machine's word does not fail a verified job: its copies are tries lost
                # there, and other machines run them (out of tries, a shard has no answer
                # from it, and its quorum decides).
                self._close(s, session, count_try=True, why=f"session failed: {failure}"[:2000])
                return
            self._close(s, session, count_try=False, why="session ended")
            if failure:
                now = dt.datetime.now(dt.UTC)
                try:
                    move_job(s, job_id, JobState.FAILED, kind=JobKind.SHARDED, reason=clean(failure),
                             updated_at=now)
                except IllegalTransition:
                    return  # the job ended meanwhile (closing the session showed it)
                cancel_shards(s, job_id, "the job failed")
                s.execute(delete(GpuReservation).where(GpuReservation.job_id == job_id))
                s.add(JobEvent(job_id=job_id, at=now, attempt=session.id, kind="failed",
                               detail=clean(failure) or ""))

    def release(self, ref: HoldRef, reason: str, failed: bool) -> None:
        """Hand the session back: a drain (its shard is queued again as it was) or a
        provider-side failure (counted against the shard's attempts)."""
        with self.db.tx() as s:
            session = session_row(s, ref, "release")
            self._close(s, session, count_try=failed,
                        why=f"{'failed on its machine' if failed else 'drained'}: {reason}")

    def requeue_expired(self, now: dt.datetime) -> list[str]:
        """Sessions whose lease ran out: their shards go back to the queue."""
        with self.db.tx() as s:
            expired = list(s.scalars(select(ShardSession).where(
                ShardSession.active.is_(True), ShardSession.lease_expires_at < now)))
            for session in expired:
                session.lost = True
                self._close(s, session, count_try=True,
                            why=f"lease of session {session.id} on machine "
                                f"{session.machine_id} expired")
            return sorted({x.job_id for x in expired})

    def _close(self, s: Session, session: ShardSession, *, count_try: bool, why: str) -> None:
        """End a session; shards it still holds are queued again (or fail, out of tries)."""
        session.active = False
        job_id = session.job_id
        if _verify_of(s, job_id) is not None:  # the job row first, as _record takes it
            s.execute(update(Job).where(Job.id == job_id).values(updated_at=Job.updated_at)
                      .execution_options(synchronize_session=False))
        max_tries = int(s.scalar(select(Job.max_attempts).where(Job.id == job_id)) or 1)
        held = s.execute(select(Shard.idx, Shard.tries, Shard.copy_of).where(
            Shard.job_id == job_id, Shard.session_id == session.id,
            Shard.state == ShardState.RUNNING.value)).all()
        requeued = failed = 0
        undecided: list[int] = []  # copies out of tries: their shards are decided on
        decided = set(s.scalars(select(Shard.idx).where(
            Shard.job_id == job_id, Shard.idx.in_([c for _, _, c in held if c is not None]),
            Shard.state.not_in([ShardState.QUEUED.value, ShardState.RUNNING.value]))))
        for idx, tries, copy_of in held:
            tries += 1 if count_try else 0
            if copy_of in decided:  # its shard needs it no more
                move_shards(s, job_id, ShardState.CANCELLED, where=[Shard.idx == idx],
                            reason="not needed: its shard was decided")
            elif tries >= max_tries:
                move_shards(s, job_id, ShardState.FAILED, where=[Shard.idx == idx], tries=tries,
                            finished_at=dt.datetime.now(dt.UTC),
                            reason=f"{why}; all {max_tries} tries used")
                if copy_of is None:
                    failed += 1
                else:
                    undecided.append(copy_of)
            else:
                move_shards(s, job_id, ShardState.QUEUED, where=[Shard.idx == idx], tries=tries,
                            session_id=None, machine_id=None)
                requeued += 1
        s.execute(delete(GpuReservation).where(
            GpuReservation.job_id == job_id, GpuReservation.attempt == session.id))
        if held:
            s.execute(update(Job).where(Job.id == job_id).values(
                shards_queued=Job.shards_queued + requeued, shards_done=Job.shards_done + failed,
                shards_failed=Job.shards_failed + failed))
            if requeued:
                _copies_wait_again(s, job_id)
        verify = _verify_of(s, job_id) if undecided else None
        for shard in undecided:
            assert verify is not None
            _decide(s, job_id, shard, verify, dt.datetime.now(dt.UTC))
        if count_try or held:
            shown = [str(i if copy_of is None else copy_of) for i, _, copy_of in held]
            s.add(JobEvent(job_id=job_id, at=dt.datetime.now(dt.UTC), attempt=session.id,
                           kind="session_lost" if count_try else "session_released",
                           detail=why + (f"; shard(s) {', '.join(shown)} queued again"
                                         if requeued else "")))
        _settle(s, job_id)

    def append_logs(self, ref: HoldRef, stream: str, seq: int, text: str) -> None:
        job_id = ref.job_id
        with self.db.tx() as s:
            # The last lines may arrive after the job ended (which closed the session); a
            # session that lost its lease sends nothing more.
            session = session_row(s, ref, "logs", ended_ok=True)
            if session.lost:
                raise StaleAttempt(f"logs from session {session.id} refused: its lease expired")
            exists = s.scalar(select(LogChunk.id).where(
                LogChunk.job_id == job_id, LogChunk.attempt == session.id,
                LogChunk.stream == stream, LogChunk.seq == seq))
            if exists is None:
                s.add(LogChunk(job_id=job_id, attempt=session.id, stream=stream, seq=seq,
                               text=(clean(text) or "")[:MAX_LOG_CHUNK]))

    def extend_active(self, lease_s: float) -> int:
        with self.db.tx() as s:
            res = s.execute(update(ShardSession).where(ShardSession.active.is_(True)).values(
                lease_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=lease_s)))
            return int(res.rowcount)  # type: ignore[attr-defined]

    def shards(self, job_id: str, *, state: str | None = None, after: int = -1,
               limit: int = 1000) -> list[ShardView]:
        q = (select(Shard).where(Shard.job_id == job_id, Shard.idx > after,
                                 Shard.copy_of.is_(None))  # copies show as their shard
             .order_by(Shard.idx).limit(limit))
        if state is not None:
            q = q.where(Shard.state == ShardState(state).value)
        with self.db.read() as s:
            job_row(s, job_id)
            rows = list(s.scalars(q))
            copies: dict[int, list[Shard]] = {}
            if rows and _verify_of(s, job_id) is not None:
                for c in s.scalars(select(Shard).where(
                        Shard.job_id == job_id, Shard.copy_of.in_([r.idx for r in rows]),
                        Shard.state.in_([ShardState.SUCCEEDED.value, ShardState.FAILED.value]))
                        .order_by(Shard.finished_at, Shard.idx)):
                    copies.setdefault(int(c.copy_of or 0), []).append(c)
            return [ShardView(r.idx, r.state, r.cost, r.tries, r.machine_id, r.exit_code,
                              json.loads(r.result_json) if r.result_json else None, r.reason,
                              r.finished_at, tuple(_shown(c, r) for c in copies.get(r.idx, [])))
                    for r in rows]

    def counts(self, job_id: str) -> dict[str, int]:
        with self.db.read() as s:
            rows = s.execute(select(Shard.state, func.count()).where(
                Shard.job_id == job_id, Shard.copy_of.is_(None)).group_by(Shard.state)).all()
        return {str(state): int(n) for state, n in rows}
