"""Every job state and every legal transition, in one place.

    submit                claim                    renew (phase)
      |                     |                          |
      v                     v                          v
   QUEUED --------------> BUILDING --------------> RUNNING
     ^  |                   |   |                    |  |
     |  |  lease expired,   |   | complete(ok=false)  |  | complete(ok=true)
     |  |  drained, or      |   v                    |  v
     |  |  handed back      |   FAILED <-------------+ SUCCEEDED  (also from BUILDING:
     |  +<------------------+                                      a job can finish before
     |                                                             its phase update lands)
     |  |                      ^
     |  |   lease expired, no attempts left
     |  +----------------------+
     |
     +-- cancel (from QUEUED, BUILDING or RUNNING) --> CANCELLED

SUCCEEDED, FAILED and CANCELLED are final. An attempt is one claim of the job by one machine;
its number is also its fencing token: a call from any other attempt is refused.

A sharded job is never leased as a whole: its shards are. The job follows its shards'
counters (SHARDED_TRANSITIONS), each shard its own small table (SHARD_TRANSITIONS):

    sharded job                                   shard
                  last queued shard handed out
   QUEUED ----------------------------------> RUNNING        QUEUED --hand out--> RUNNING
     ^ |  <---------------------------------   |   |           ^  |                 |  |
     | |    a shard is queued again            |   |           |  |  session lost,  |  | result
     | |    (its session lost or released)     |   |           |  +- tries left ----+  v
     | |                                       |   |           |                  SUCCEEDED
     | +-- a session's build fails --> FAILED <+   |           |                  FAILED (or
     |     (the job's own fault)        ^          |           |                   out of tries)
     |                                  +- every shard ended,  |
     |                                     one failed          +-- job failed/cancelled
     |                         SUCCEEDED <- every shard ended ok     --> CANCELLED (from both)
     +-- cancel (from QUEUED or RUNNING) --> CANCELLED

A verified job (spec.verify) is never leased either: its replicas are, each a plain job of
its own. It follows them (VERIFIED_TRANSITIONS): QUEUED until one is leased, RUNNING after,
and final when a quorum of their answers agrees (SUCCEEDED or FAILED as that answer says),
when they disagree past the job's bound (FAILED), or when it is cancelled.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar, cast


class JobState(enum.StrEnum):
    QUEUED = "queued"
    BUILDING = "building"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL

    @property
    def active(self) -> bool:
        """Held by a machine under a lease."""
        return self in ACTIVE


FINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.BUILDING, JobState.RUNNING})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.BUILDING, JobState.CANCELLED}),
    # BUILDING -> SUCCEEDED: the phase is reported by lease renewal, which a short job
    # can outrun; the fencing token, not the phase, says who may finish.
    JobState.BUILDING: frozenset(
        {JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED,
         JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


# A sharded job: QUEUED while shards wait, RUNNING once all are handed out, final when
# every shard has ended (or a session's build failed, or it was cancelled).
SHARDED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.BUILDING: frozenset(),  # never: shards are built per session, on the machine
    JobState.RUNNING: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


VERIFIED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED,
                                JobState.CANCELLED}),
    JobState.BUILDING: frozenset(),  # never: its replicas are built, each on its machine
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class JobKind(enum.Enum):
    """Which table a job's moves follow: a plain job's (leased by attempts), a sharded job's
    (its shards are leased), or a verified job's (its replicas are)."""

    PLAIN = "plain"
    SHARDED = "sharded"
    VERIFIED = "verified"

    @property
    def transitions(self) -> dict[JobState, frozenset[JobState]]:
        return {JobKind.PLAIN: TRANSITIONS, JobKind.SHARDED: SHARDED_TRANSITIONS,
                JobKind.VERIFIED: VERIFIED_TRANSITIONS}[self]


class ShardState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # held by a session
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


SHARD_TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    ShardState.QUEUED: frozenset({ShardState.RUNNING, ShardState.CANCELLED}),
    ShardState.RUNNING: frozenset(
        {ShardState.SUCCEEDED, ShardState.FAILED, ShardState.QUEUED, ShardState.CANCELLED}
    ),
    ShardState.SUCCEEDED: frozenset(),
    ShardState.FAILED: frozenset(),
    ShardState.CANCELLED: frozenset(),
}

S = TypeVar("S", JobState, ShardState)


def can_move(src: S, dst: S, table: Mapping[S, frozenset[S]] | None = None) -> bool:
    return dst in (table if table is not None else _table_of(src))[src]


def sources_of(dst: S, table: Mapping[S, frozenset[S]] | None = None) -> frozenset[S]:
    """The states from which `dst` may be entered: the guard of a conditional update."""
    table = table if table is not None else _table_of(dst)
    return frozenset(s for s, targets in table.items() if dst in targets)


def _table_of(state: S) -> Mapping[S, frozenset[S]]:
    table: Any = SHARD_TRANSITIONS if isinstance(state, ShardState) else TRANSITIONS
    return cast("Mapping[S, frozenset[S]]", table)
