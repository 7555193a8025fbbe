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
"""

from __future__ import annotations

import enum


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


def can_move(src: JobState, dst: JobState) -> bool:
    return dst in TRANSITIONS[src]


def sources_of(dst: JobState) -> frozenset[JobState]:
    """The states from which `dst` may be entered: the guard of a conditional update."""
    return frozenset(s for s, targets in TRANSITIONS.items() if dst in targets)
