"""Verified jobs in the database: their replicas, quorum.py's decisions applied in the
transaction of the replica that ended, and each machine's record against quorums (its
agreements, its quarantine, and the results it made that can no longer be trusted).

Every function here runs inside the caller's transaction (the store's operations and the
claim), so a decision and the replica end that caused it commit together.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import random
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.orm import Session

from campugrid.coordinator.machines import Status, bump_epoch, end_leases
from campugrid.coordinator.models import (
    Checkpoint,
    GpuReservation,
    ImageBuild,
    ImagePull,
    Job,
    JobEvent,
    Machine,
    ReplicaMachine,
    Shard,
)
from campugrid.coordinator.moves import move_job
from campugrid.coordinator.quorum import Answer, Decision, answer_key, decide, shares_host
from campugrid.coordinator.views import stored_spec
from campugrid.protocol.spec import MAX_ENV, MAX_ENV_VALUE
from campugrid.protocol.states import JobKind, JobState, ShardState

# A checkpoint's verdict (Checkpoint.verdict; checks.py). Those in NOT_RESUMED are never resumed
# from (claims.RESUMABLE).
AGREED, REJECTED, UNTRUSTED = "agreed", "rejected", "untrusted"
UNVERIFIABLE, DISPUTED = "unverifiable", "disputed"
NOT_RESUMED = (REJECTED, UNTRUSTED, UNVERIFIABLE, DISPUTED)


def work_of(job: Job, spec_json: str, what: str, now: dt.datetime, **fields: Any) -> Job:
    """A queued job doing part of `job`'s verifying (a replica, a check, a comparison): its
    files, bases, owner and sizes, and `spec_json`; named "<job>: <what>"; `fields` set the
    rest (what it is part of, whom it is kept apart from, its place in the queue)."""
    values: dict[str, Any] = {
        "share": job.share, "created_at": job.created_at, **fields}
    return Job(
        id=str(uuid.uuid4()), owner_id=job.owner_id, client_job_id=None,
        name=f"{job.name or 'job ' + job.id[:8]}: {what}", state=JobState.QUEUED.value,
        spec_json=spec_json, context_key=job.context_key, context_sha256=job.context_sha256,
        attempt=0, max_attempts=job.max_attempts, gpus_needed=job.gpus_needed,
        limits_needed=job.limits_needed, cpus_needed=job.cpus_needed,
        memory_needed_mb=job.memory_needed_mb, disk_needed_mb=job.disk_needed_mb,
        shards_total=0, shards_queued=0, shards_done=0, shards_failed=0,
        bases_json=job.bases_json, updated_at=now, **values)


def make_replicas(s: Session, parent: Job, n: int, now: dt.datetime) -> list[str]:
    """`n` more replicas of the verified job `parent` (a row of this session), queued: each a
    plain job with the parent's spec but for verify, its files, bases and owner. They keep
    the parent's place in the queue."""
    spec = stored_spec(parent.spec_json).as_replica()
    text, made = spec.to_json(), []
    for i in range(parent.replicas, parent.replicas + n):
        row = work_of(parent, text, f"replica {i + 1}", now, replica_of=parent.id,
                      apart=parent.id)
        s.add(row)
        made.append(row.id)
        s.add(JobEvent(job_id=parent.id, at=now, attempt=0, kind="replica",
                       detail=f"replica {i + 1} is job {row.id}"))
    parent.replicas += n
    return made


def one_party(conn: Connection | Session, machine_id: str) -> set[str]:
    """The machines that count as one party with this one, for replicas, copies and checks:
    itself, those that registered from its address (quorum.shares_host), and those an admin
    said have its owner."""
    found = conn.execute(select(Machine.address, Machine.owner)
                         .where(Machine.id == machine_id)).first()
    address, owner = (found[0] or "", found[1] or "") if found is not None else ("", "")
    same = {machine_id}
    if shares_host(address):
        same |= set(conn.scalars(select(Machine.id).where(Machine.address == address)))
    if owner:
        same |= set(conn.scalars(select(Machine.id).where(Machine.owner == owner)))
    return same


def kept_apart(conn: Connection | Session, group: str, job_id: str, machine_id: str) -> None:
    """Job `job_id` of the group `group` (a verified job's replicas, a checkpoint's checks)
    was just leased to this machine (in the claim's transaction): neither it nor any machine
    at its address is given another job of the group."""
    same = one_party(conn, machine_id)
    have = set(conn.scalars(select(ReplicaMachine.machine_id).where(
        ReplicaMachine.job_id == group, ReplicaMachine.machine_id.in_(sorted(same)))))
    if same - have:
        conn.execute(insert(ReplicaMachine), [{"job_id": group, "machine_id": m,
                                               "replica_id": job_id}
                                              for m in sorted(same - have)])


def leased_replica(conn: Connection, parent_id: str, replica_id: str, machine_id: str,
                   now: dt.datetime, events: list[dict[str, Any]]) -> None:
    """A replica of `parent_id` was just leased to this machine: the verified job is running."""
    # The replica's row is locked here, and a decision locks the verified job before its
    # replicas: so the verified job is moved only if no one holds it (else settle does it).
    free = (select(Job.id).where(Job.id == parent_id, Job.state == JobState.QUEUED.value)
            .with_for_update(skip_locked=True).scalar_subquery())
    moved = conn.execute(update(Job).where(Job.id == free)
                         .values(state=JobState.RUNNING.value, updated_at=now))
    if moved.rowcount:
        events.append({"job_id": parent_id, "at": now, "attempt": 0, "kind": "running",
                       "detail": f"its first replica was leased to machine {machine_id}"})


def settle(s: Session, parent_id: str, now: dt.datetime, sample: float | None = None) -> Decision:
    """A replica of `parent_id` ended: apply quorum.decide to every replica's answer."""
    parent = s.execute(select(Job).where(Job.id == parent_id).with_for_update()).scalar_one()
    if JobState(parent.state).final:
        return Decision()
    verify = stored_spec(parent.spec_json).verify
    assert verify is not None
    replicas = list(s.scalars(select(Job).where(Job.replica_of == parent_id)
                              .order_by(Job.updated_at, Job.id)))
    ended = [r for r in replicas if JobState(r.state).final]
    answers = [Answer(r.id, r.machine_id or "", _key(r)) for r in ended]
    machines = {a.machine_id for a in answers if a.machine_id}
    streak = {m.id: m.streak for m in s.scalars(select(Machine).where(
        Machine.id.in_(sorted(machines))))}
    compares = (list(s.scalars(select(Job).where(Job.compare_of == parent_id)
                               .order_by(Job.created_at, Job.id)))
                if verify.compare is not None else [])
    verdicts = verdicts_of(compares) if verify.compare is not None else None
    if verdicts:
        cancel_judged(s, compares, verdicts, now)
    decision = decide(verify, answers, pending=len(replicas) - len(ended), made=parent.replicas,
                      streak=streak, draw=draw() if sample is None else sample,
                      verdicts=verdicts)
    if decision.compare:
        by_id = {r.id: r for r in replicas}
        for a, b in decision.compare:
            for _ in range(judges_wanted(compares, (a, b))):
                make_compare(s, parent, verify.compare or (), (a, b),
                             (by_id[a].result or "", by_id[b].result or ""), parent.id, now)
    elif decision.more:
        made = make_replicas(s, parent, decision.more, now)
        _event(s, parent, now, "disagreed" if len({a.key for a in answers if a.key}) > 1
               else "replicated", f"{len(made)} more replica(s): "
               + "; ".join(f"machine {a.machine_id[:8]}: {a.says()}" for a in answers))
    elif decision.fail:
        move_job(s, parent.id, JobState.FAILED, kind=JobKind.VERIFIED, reason=decision.fail,
                 updated_at=now)
        _event(s, parent, now, "failed", decision.fail)
        _cancel_rest(s, parent, replicas, now, "its results can no longer agree")
    elif decision.accept:
        _accept(s, parent, decision, replicas, now)
    elif parent.state == JobState.QUEUED.value and any(JobState(r.state).active for r in replicas):
        move_job(s, parent.id, JobState.RUNNING, kind=JobKind.VERIFIED, updated_at=now)
    return decision


# "Alike" takes this many judges' word (each a machine of its own); "unlike" one's. A pair whose
# comparisons ended this many times without an answer cannot be judged: not alike, no one blamed.
JUDGES = 2
COMPARE_TRIES = 4


def verdicts_of(compares: list[Job]) -> dict[frozenset[str], bool | None]:
    """What the job's compare command said of each pair, by the comparisons that ended: exit
    0 from JUDGES judges alike (True), another exit code of its own from any unlike (False);
    None: it could not be judged (its comparisons kept ending without an answer: killed,
    their machines failing). Pairs still being judged are absent."""
    alike: dict[frozenset[str], int] = {}
    failed: dict[frozenset[str], int] = {}
    said: dict[frozenset[str], bool | None] = {}
    for c in compares:
        if not JobState(c.state).final:
            continue
        pair = frozenset((c.compare_pair or "").split(","))
        code = c.exit_code
        if c.state == JobState.CANCELLED.value or code is None or not 0 <= code < 128:
            failed[pair] = failed.get(pair, 0) + 1  # no answer of the command's own
        elif code == 0:
            alike[pair] = alike.get(pair, 0) + 1
        else:
            said[pair] = False
    for pair, n in alike.items():
        if pair not in said and n >= JUDGES:
            said[pair] = True
    for pair, n in failed.items():
        if pair not in said and n >= COMPARE_TRIES:
            said[pair] = None
    return said


def cancel_judged(s: Session, compares: list[Job], said: Mapping[frozenset[str], object],
                  now: dt.datetime) -> None:
    """Comparisons still queued or running for a pair already judged are not needed."""
    for c in compares:
        if not JobState(c.state).final and frozenset((c.compare_pair or "").split(",")) in said:
            move_job(s, c.id, JobState.CANCELLED, machine_id=None, lease_expires_at=None,
                     reason="not needed: the pair was judged", updated_at=now)
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == c.id))


def judges_wanted(compares: list[Job], pair: tuple[str, str]) -> int:
    """How many more comparisons of an unjudged pair to queue: JUDGES, less those that said
    alike and those still running."""
    mine = [c for c in compares if set((c.compare_pair or "").split(",")) == set(pair)]
    busy = sum(1 for c in mine if not JobState(c.state).final
               or (c.state != JobState.CANCELLED.value and c.exit_code == 0))
    return max(0, JUDGES - busy)


def pair_group(pair: tuple[str, str]) -> str:
    """The name under which one pair's judges are kept apart (and from the work they judge)."""
    return "cmp-" + hashlib.sha256(",".join(sorted(pair)).encode()).hexdigest()[:32]


def make_compare(s: Session, job: Job, command: tuple[str, ...], pair: tuple[str, str],
                 results: tuple[str, str], party: str, now: dt.datetime) -> None:
    """A comparison of a pair (two replicas of `job`, by id; or two checkpoints, "ckpt:<id>")
    by the job's own compare command: a job of its own, on a machine that did none of the work
    of `party` (a verified job's replicas, a checkpoint's maker and checks) nor judged the pair
    before; once it judges, it does none of that work either (claims: kept_apart)."""
    group = pair_group(pair)
    for machine in s.scalars(select(ReplicaMachine.machine_id).where(
            ReplicaMachine.job_id == party)):
        if s.get(ReplicaMachine, (group, machine)) is None:
            s.add(ReplicaMachine(job_id=group, machine_id=machine, replica_id=party))
    s.flush()
    base = stored_spec(job.spec_json).as_replica()
    env = dict(base.env)
    if len(env) + 2 <= MAX_ENV:  # the result lines too, where the spec leaves room
        env |= {"COMPARE_RESULT_A": results[0][:MAX_ENV_VALUE],
                "COMPARE_RESULT_B": results[1][:MAX_ENV_VALUE]}
    spec = dataclasses.replace(base, command=command, datasets=(), env=tuple(sorted(env.items())))
    what = " and ".join(p[:13] for p in pair)
    row = work_of(job, spec.to_json(), f"compare {what}", now, share=None, apart=group,
                  compare_of=job.id, compare_pair=",".join(pair))
    s.add(row)
    _event(s, job, now, "compare", f"{what} differ: job {row.id} runs the job's compare "
           "command on them")


def lock_parent(s: Session, job_id: str) -> None:
    """Before a job's row is written: lock its verified job (if it is a replica), so that
    every path takes the two in one order (a decision holds the verified job and writes its
    replicas); before a check's, the job it checks (and that one's verified job); then the
    job itself (a check's decision reads its checkpoints, which its own attempt writes)."""
    found = s.execute(select(Job.replica_of, Job.check_of, Job.compare_of)
                      .where(Job.id == job_id)).first()
    if found is None:
        return
    parent, check_of, compare_of = found
    parent = parent or compare_of
    if check_of is not None:
        parent = s.scalar(select(Checkpoint.job_id).where(Checkpoint.id == check_of))
        if parent is not None:
            lock_parent(s, parent)
    if parent is not None:
        s.execute(select(Job.id).where(Job.id == parent).with_for_update())
    s.execute(select(Job.id).where(Job.id == job_id).with_for_update())


def _accept(s: Session, parent: Job, decision: Decision, replicas: list[Job],
            now: dt.datetime) -> None:
    first = next(r for r in replicas if r.id == decision.accept[0].replica)
    ok = first.state == JobState.SUCCEEDED.value
    agreed = [a.machine_id for a in decision.accept]
    how = (f"{len(agreed)} replicas agreed (machines {', '.join(m[:8] for m in agreed)})"
           if decision.checked else
           f"taken from machine {agreed[0][:8]} alone: it has earned adaptive trust")
    move_job(s, parent.id, JobState.SUCCEEDED if ok else JobState.FAILED,
             kind=JobKind.VERIFIED, exit_code=first.exit_code, result=first.result,
             output_key=first.output_key, output_files_json=first.output_files_json,
             limits_json=first.limits_json, machine_id=first.machine_id,
             reason=first.reason if not ok else None, updated_at=now)
    _event(s, parent, now, "verified", how)
    _cancel_rest(s, parent, replicas, now, how)
    judge(s, decision, now, f"job {parent.id}")


def judge(s: Session, decision: Decision, now: dt.datetime, on: str,
          trust: bool = True) -> None:
    """An accepted, checked decision: the machines that agreed earn trust (with `trust`; a
    checkpoint check only counts an agreement); those that answered against it are
    quarantined, with the evidence."""
    if not decision.checked or not decision.accept:
        return
    agreed_by = [a.machine_id for a in decision.accept]
    agreed(s, agreed_by, now, trust)
    said = decision.accept[0].says()
    for a in decision.against:
        quarantine(s, a.machine_id, now, f"on {on} it answered {a.says()}, where "
                   f"{len(agreed_by)} other machines agreed on {said}")


def agreed(s: Session, machines: list[str], now: dt.datetime, trust: bool = True) -> None:
    """These machines' answers agreed with a quorum: their records say so. Only results earn
    adaptive trust (`trust`: the streak, and the time since which what they make would be
    tainted); a checkpoint check is cheap to pass, and counts as an agreement only."""
    values: dict[str, Any] = {"agreed": Machine.agreed + 1}
    if trust:
        values |= {"streak": Machine.streak + 1, "last_agreed_at": now}
    s.execute(update(Machine).where(Machine.id.in_(sorted(set(machines)))).values(**values)
              .execution_options(synchronize_session=False))


def _cancel_rest(s: Session, parent: Job, replicas: list[Job], now: dt.datetime,
                 why: str) -> None:
    """The replicas still queued or running are not needed: the job was decided."""
    for r in replicas:
        if not JobState(r.state).final:
            move_job(s, r.id, JobState.CANCELLED, machine_id=None, lease_expires_at=None,
                     reason=f"not needed: job {parent.id} was decided ({why})", updated_at=now)
            s.add(JobEvent(job_id=r.id, at=now, attempt=r.attempt, kind="cancelled",
                           detail="not needed: the verified job was decided"))
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == r.id))
            cancel_queued_checks(s, r.id, now)
    for c in s.scalars(select(Job).where(Job.compare_of == parent.id)):
        if not JobState(c.state).final:
            move_job(s, c.id, JobState.CANCELLED, machine_id=None, lease_expires_at=None,
                     reason=f"not needed: job {parent.id} was decided ({why})", updated_at=now)
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == c.id))


def quarantine(s: Session, machine_id: str, now: dt.datetime, why: str) -> None:
    """The machine answered against a quorum: it gets no work until an admin reinstates or
    revokes it, its leases end now, and the results it made since it last agreed with a
    quorum are marked tainted on their jobs."""
    m = s.get(Machine, machine_id)
    if m is None:
        return
    since = m.last_agreed_at
    m.disagreed += 1
    m.streak = 0
    if m.status != Status.REVOKED.value:
        m.status, m.quarantine = Status.QUARANTINED.value, why[:4000]
    bump_epoch(s)
    end_leases(s, machine_id)
    # Its checkpoints that no check agreed with, and all made from them, are not resumed from.
    suspect = set(s.scalars(select(Checkpoint.id).where(
        Checkpoint.machine_id == machine_id,
        Checkpoint.verdict.is_(None) | (Checkpoint.verdict != AGREED))))
    distrust(s, suspect, UNTRUSTED, now, f"made by machine {machine_id[:8]} (quarantined) or "
             "from a checkpoint it made")
    by = (f"machine {machine_id[:8]}, quarantined {now:%Y-%m-%d %H:%M} UTC after it answered "
          f"against a quorum; run the job again with `campugrid rerun`")
    taint = f"its result was made by {by}"
    q = (update(Job).where(Job.machine_id == machine_id, Job.replica_of.is_(None),
                           Job.state.in_([JobState.SUCCEEDED.value, JobState.FAILED.value]),
                           Job.tainted.is_(None))
         .values(tainted=taint).execution_options(synchronize_session=False))
    if since is not None:
        q = q.where(Job.updated_at > since)
    s.execute(q)
    # Its image builds are handed out no more, and the jobs (a replica's: its verified job)
    # that ran an image it alone built since then are tainted.
    s.execute(update(ImageBuild).where(ImageBuild.machine_id == machine_id,
                                       ImageBuild.withdrawn_at.is_(None))
              .values(withdrawn_at=now).execution_options(synchronize_session=False))
    pulls = select(ImagePull.job_id).where(ImagePull.builder == machine_id)
    if since is not None:
        pulls = pulls.where(ImagePull.at > since)
    ran = set(s.scalars(pulls.distinct()))
    for job_id, parent, check_of, compare_of in s.execute(
            select(Job.id, Job.replica_of, Job.check_of, Job.compare_of)
            .where(Job.id.in_(sorted(ran)))):
        # A replica's, a comparison's: the verified job; a check's: the job it checked.
        served = parent or compare_of or (s.scalar(select(Checkpoint.job_id).where(
            Checkpoint.id == check_of)) if check_of is not None else None) or job_id
        s.execute(update(Job).where(Job.id == served, Job.tainted.is_(None))
                  .values(tainted=f"it ran an image built by {by}")
                  .execution_options(synchronize_session=False))
    # Sharded jobs: the shards it answered (taken unchecked, or from it alone) since then.
    shards = (select(Shard.job_id, Shard.idx).where(
        Shard.machine_id == machine_id, Shard.copy_of.is_(None),
        Shard.state.in_([ShardState.SUCCEEDED.value, ShardState.FAILED.value]))
        .order_by(Shard.job_id, Shard.idx))
    if since is not None:
        shards = shards.where(Shard.finished_at > since)
    by_job: dict[str, list[int]] = {}
    for job_id, idx in s.execute(shards):
        by_job.setdefault(job_id, []).append(int(idx))
    for job_id, idxs in by_job.items():
        named = ", ".join(map(str, idxs[:20])) + (f" and {len(idxs) - 20} more"
                                                   if len(idxs) > 20 else "")
        s.execute(update(Job).where(Job.id == job_id, Job.tainted.is_(None))
                  .values(tainted=f"shard(s) {named} were answered by {by}")
                  .execution_options(synchronize_session=False))


def distrust(s: Session, roots: set[int], verdict: str, now: dt.datetime, why: str) -> set[int]:
    """These checkpoints, and every checkpoint made from them (parent links), get `verdict`:
    never resumed from. A job whose current attempt resumed from one or made one goes back to
    the queue (without costing an attempt) to resume from a good one; a job that ended so is
    marked tainted. Returns what was marked."""
    if not roots:
        return set()
    jobs = set(s.scalars(select(Checkpoint.job_id).where(Checkpoint.id.in_(sorted(roots)))))
    rows = list(s.execute(select(Checkpoint.id, Checkpoint.parent_id, Checkpoint.job_id,
                                 Checkpoint.attempt).where(Checkpoint.job_id.in_(sorted(jobs)))))
    children: dict[int, list[int]] = {}
    for cid, parent, _, _ in rows:
        if parent is not None:
            children.setdefault(parent, []).append(cid)
    marked, todo = set(), list(roots)
    while todo:
        one = todo.pop()
        if one not in marked:
            marked.add(one)
            todo += children.get(one, [])
    if verdict == UNTRUSTED:  # a rejection found by a check stays one
        keep = REJECTED
        s.execute(update(Checkpoint).where(Checkpoint.id.in_(sorted(marked)),
                                           Checkpoint.verdict.is_(None) | (Checkpoint.verdict != keep))
                  .values(verdict=verdict).execution_options(synchronize_session=False))
    else:
        s.execute(update(Checkpoint).where(Checkpoint.id.in_(sorted(marked)))
                  .values(verdict=verdict).execution_options(synchronize_session=False))
    made_in = {(job_id, attempt) for cid, _, job_id, attempt in rows if cid in marked}
    for job in s.scalars(select(Job).where(Job.id.in_(sorted(jobs)))):
        if not ((job.id, job.attempt) in made_in or job.resume_id in marked):
            continue  # its current attempt (or its end) was not computed from them
        if JobState(job.state).active:
            move_job(s, job.id, JobState.QUEUED, machine_id=None, lease_expires_at=None,
                     drained=Job.drained + 1, updated_at=now,
                     reason=f"a checkpoint it was computing from is {verdict} ({why}): it "
                            "resumes from a good one")
            s.execute(delete(GpuReservation).where(GpuReservation.job_id == job.id))
            _event(s, job, now, "requeued", f"its checkpoints are {verdict}: {why}")
        elif job.state in (JobState.SUCCEEDED.value, JobState.FAILED.value) and not job.tainted:
            job.tainted = (f"its result was computed from a checkpoint that is {verdict} "
                           f"({why}); run the job again with `campugrid rerun`")
    return marked


def cancel_queued_checks(s: Session, job_id: str, now: dt.datetime) -> None:
    """The job ended: checks of its checkpoints that no machine has taken are not needed, but
    for a tie-breaker (a check already disagreed with the maker: someone lied, and must be
    found). Those running finish, and count for their machines' records."""
    mine = select(Checkpoint.id).where(Checkpoint.job_id == job_id).scalar_subquery()
    answered = set(s.scalars(select(Job.check_of).where(
        Job.check_of.in_(mine), Job.state == JobState.SUCCEEDED.value)))
    for check in s.scalars(select(Job).where(Job.check_of.in_(mine),
                                             Job.state == JobState.QUEUED.value)):
        if check.check_of not in answered:
            move_job(s, check.id, JobState.CANCELLED, updated_at=now,
                     reason="not needed: the job it checks ended")


_SAMPLER = random.SystemRandom()


def draw() -> float:
    """The adaptive check's sample: unpredictable, so that no machine can tell in advance
    which of its answers will be checked."""
    return _SAMPLER.random()


def _key(r: Job) -> tuple[int | None, str, str] | None:
    return answer_key(r.state, r.exit_code, r.result, r.output_digest)


def _event(s: Session, parent: Job, now: dt.datetime, kind: str, detail: str) -> None:
    s.add(JobEvent(job_id=parent.id, at=now, attempt=0, kind=kind, detail=detail[:4000]))

