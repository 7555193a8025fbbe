"""What a machine holds, and the one check that it still holds it.

A machine holds work by a lease. Two kinds exist (a verified job's replicas are plain jobs of
their own, so a replica's hold is an attempt):

    kind      what it is                          its fencing token   where it lives
    ATTEMPT   a plain job's current attempt        the attempt number  the job's row
    SESSION   one machine working through shards   the session's id    a shard_sessions row

Every call about held work names its hold, `HoldRef`: the job, the kind (a field of each
wire message, never guessed from the token), the token the lease gave, and the machine
calling. `Holds.of(ref)` resolves it once and offers the same verbs for every kind:

    check(what)      the fence alone: StaleAttempt (not held by this machine now) or
                     IllegalTransition (held, but the job has moved on)
    renew(...)       keep it for another lease period (an attempt also moves BUILDING ->
                     RUNNING)
    log(...)         a chunk of its build or run log (a retried chunk is stored once)
    checkpoint(...)  record a checked checkpoint; checkpoint_allowed() says first whether
                     the kind takes any (attempts do; a lost shard runs again from its start)
    finish(...)      its end as the machine reports it
    release(...)     hand it back: drained, failed there, or this machine cannot run it
    next_shard(...)  a session's result for its shard, and its next shard (attempts have none)

Whether a hold is still live, for the image steps, is fence.live.

The kinds and `HoldRef` are in views.py; the fence itself, once per kind, in fence.py,
which the stores' operations use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from campugrid.coordinator.fence import session_row
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import HoldKind, HoldRef, ShardResult, ShardTask
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.states import JobState

# --- the verbs -----------------------------------------------------------------------------


class Hold(Protocol):
    @property
    def ref(self) -> HoldRef: ...

    @property
    def takes_output(self) -> bool:
        """Whether it uploads an /output archive (an attempt) or reports results (a session)."""
        ...

    def check(self, what: str) -> None: ...

    def renew(self, phase: JobState, lease_s: float) -> None: ...

    def log(self, stream: str, seq: int, text: str) -> None: ...

    def checkpoint_allowed(self) -> None: ...

    def checkpoint(self, *, epoch: int, key: str, size: int, sha256: str,
                   keep: int, content_digest: str | None = None, label: str = "") -> list[str]: ...

    def finish(self, *, succeeded: bool, exit_code: int | None = None,
               reason: str | None = None, result: str | None = None,
               output_key: str | None = None, limits: dict[str, str] | None = None,
               output_files: Sequence[tuple[str, int]] = (),
               output_digest: str | None = None) -> None: ...

    def release(self, reason: str, *, failed: bool, cannot_run_here: bool = False) -> None: ...

    def next_shard(self, done: ShardResult | None, *, heavy_first: bool) -> ShardTask | None: ...


@dataclasses.dataclass(frozen=True)
class AttemptHold:
    """A plain job's attempt: its state is the job row's."""

    store: Store
    ref: HoldRef
    takes_output = True

    def check(self, what: str) -> None:
        self.store.check_attempt(self.ref, what)

    def renew(self, phase: JobState, lease_s: float) -> None:
        self.store.renew_lease(self.ref, phase, lease_s)

    def log(self, stream: str, seq: int, text: str) -> None:
        self.store.append_logs(self.ref, stream, seq, text)

    def checkpoint_allowed(self) -> None:
        pass

    def checkpoint(self, *, epoch: int, key: str, size: int, sha256: str,
                   keep: int, content_digest: str | None = None, label: str = "") -> list[str]:
        return self.store.checkpoints.record(self.ref, epoch=epoch, key=key, size=size,
                                            sha256=sha256, keep=keep,
                                            content_digest=content_digest, label=label)

    def finish(self, *, succeeded: bool, exit_code: int | None = None,
               reason: str | None = None, result: str | None = None,
               output_key: str | None = None, limits: dict[str, str] | None = None,
               output_files: Sequence[tuple[str, int]] = (),
               output_digest: str | None = None) -> None:
        self.store.finish(self.ref, succeeded=succeeded, exit_code=exit_code, reason=reason,
                          result=result, output_key=output_key, limits=limits or {},
                          output_files=output_files, output_digest=output_digest)

    def release(self, reason: str, *, failed: bool, cannot_run_here: bool = False) -> None:
        self.store.release(self.ref, reason, failed=failed, cannot_run_here=cannot_run_here)

    def next_shard(self, done: ShardResult | None, *, heavy_first: bool) -> ShardTask | None:
        raise InvalidInput("next shard: this hold is a plain job's attempt, not a shard session")


@dataclasses.dataclass(frozen=True)
class SessionHold:
    """A session of a sharded job: its state is its own row and its shards'."""

    store: Store
    ref: HoldRef
    takes_output = False

    def check(self, what: str) -> None:
        with self.store.read() as s:
            session_row(s, self.ref, what)

    def renew(self, phase: JobState, lease_s: float) -> None:
        self.store.shards.renew(self.ref, lease_s)

    def log(self, stream: str, seq: int, text: str) -> None:
        self.store.shards.append_logs(self.ref, stream, seq, text)

    def checkpoint_allowed(self) -> None:
        raise InvalidInput("shards do not checkpoint: a lost shard runs again from its start")

    def checkpoint(self, *, epoch: int, key: str, size: int, sha256: str,
                   keep: int, content_digest: str | None = None, label: str = "") -> list[str]:
        self.checkpoint_allowed()
        return []

    def finish(self, *, succeeded: bool, exit_code: int | None = None,
               reason: str | None = None, result: str | None = None,
               output_key: str | None = None, limits: dict[str, str] | None = None,
               output_files: Sequence[tuple[str, int]] = (),
               output_digest: str | None = None) -> None:
        """A failed session is the job's own fault (its image does not build, its shard
        runner cannot start), so the job fails with it; shards report results, not output."""
        failure = None if succeeded else ((reason or "")[:4000] or "session failed")
        self.store.shards.end(self.ref, failure=failure)

    def release(self, reason: str, *, failed: bool, cannot_run_here: bool = False) -> None:
        # The session's token is checked first; the machine asking is the one handing back,
        # so it asks for no other work before its refusal is written.
        self.store.shards.release(self.ref, reason, failed=failed and not cannot_run_here)
        if cannot_run_here:
            self.store.refuse(self.ref.job_id, self.ref.machine_id, reason)

    def next_shard(self, done: ShardResult | None, *, heavy_first: bool) -> ShardTask | None:
        return self.store.shards.next_shard(self.ref, done, heavy_first=heavy_first)


class Holds:
    """Resolves a hold to its kind's verbs."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def of(self, ref: HoldRef) -> Hold:
        kind: type[AttemptHold] | type[SessionHold] = (
            SessionHold if ref.kind is HoldKind.SESSION else AttemptHold)
        return kind(self.store, ref)
