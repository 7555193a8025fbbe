"""The one way a state is written: a guarded move.

A move is a conditional UPDATE whose WHERE names the legal source states from
`protocol.states` (for a plain job, a sharded job, or a shard), checks how many rows it
changed, and raises a domain error when that is not what the caller expected. So an illegal
transition or a call from a stale attempt cannot slip through, even under races; the caller
adds its own guards (the attempt, the machine, the lease) as `where`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from campugrid.coordinator.models import Job, Shard
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import CampugridError, IllegalTransition
from campugrid.protocol.states import JobKind, JobState, ShardState, sources_of

Refusal = Callable[[], CampugridError]


def move_job(s: Session, job_id: str, target: JobState, *, kind: JobKind = JobKind.PLAIN,
             within: Collection[JobState] | None = None, stay: bool = False,
             where: Sequence[ColumnElement[bool]] = (), refused: Refusal | None = None,
             **values: Any) -> None:
    """Move one job of this `kind` to `target` from a state its table allows (`within` narrows
    them; `stay` also lets a job already in `target` update its other columns), or raise
    `refused()` (default IllegalTransition) when the row did not match."""
    sources = set(sources_of(target, kind.transitions)) | ({target} if stay else set())
    if within is not None:
        sources &= set(within)
    res = s.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_(sorted(x.value for x in sources)),
               *_OF_KIND[kind], *where)
        .values(state=target.value, **{"updated_at": utcnow(), **values}))
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise refused() if refused is not None else IllegalTransition(
            f"job {job_id} cannot become {target.value} now")


_OF_KIND: dict[JobKind, tuple[ColumnElement[bool], ...]] = {
    JobKind.PLAIN: (Job.shards_total == 0, Job.replicas == 0),
    JobKind.SHARDED: (Job.shards_total > 0,),
    JobKind.VERIFIED: (Job.replicas > 0,),
}


def kind_of(row: Job) -> JobKind:
    return (JobKind.SHARDED if row.shards_total else JobKind.VERIFIED if row.replicas
            else JobKind.PLAIN)


def move_shards(s: Session, job_id: str, target: ShardState, *,
                where: Sequence[ColumnElement[bool]] = (), expect: int | None = 1,
                refused: Refusal | None = None, **values: Any) -> int:
    """Move the job's shards that `where` picks to `target`, from the states the shard
    table allows; `expect` rows must match (None: any number). The number moved."""
    sources = sources_of(target)
    res = s.execute(
        update(Shard)
        .where(Shard.job_id == job_id, Shard.state.in_(sorted(x.value for x in sources)), *where)
        .values(state=target.value, **values)
        .execution_options(synchronize_session=False))
    moved = int(res.rowcount)  # type: ignore[attr-defined]
    if expect is not None and moved != expect:
        raise refused() if refused is not None else IllegalTransition(
            f"{expect} shard(s) of job {job_id} cannot become {target.value} now ({moved} could)")
    return moved
