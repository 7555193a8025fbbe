"""The coordinator as a task sees it (client.CoordinatorApi), in memory, for the agent's unit
tests: it holds the holds it granted and answers for them as the coordinator does (renewals
keep going while the hold is live; logs, completion and hand-back are accepted once, from the
live hold only; a cancelled job's renewal says so), and records what it was told.
tests/integration/test_coordinator_api_contract.py runs the same cases against it and
against the real coordinator over gRPC."""

from __future__ import annotations

import threading

from campugrid.agent.messages import (
    CheckpointRecord,
    CheckpointUpload,
    Hold,
    Lease,
    Outcome,
    Renewal,
    Verdict,
)

LEASE_S = 12.0


class FakeCoordinator:
    machine_id = "machine-test"
    address = "127.0.0.1:8751"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Hold] = set()
        self._ended: dict[str, str] = {}  # job -> how it ended, as a refusal says it
        self.renewals: list[str] = []  # the phases renewals carried
        self.lines: list[tuple[str, str]] = []  # (stream, line) of every accepted log chunk
        self.completed: list[tuple[str, int, Outcome]] = []
        self.released: list[tuple[str, int, str, bool]] = []

    def grant(self, lease: Lease) -> Lease:
        """The coordinator leased `lease` to this machine: its hold is live."""
        with self._lock:
            self._live.add(lease.hold)
        return lease

    def cancel(self, job_id: str) -> None:
        """The job was cancelled: its hold ends, and its next renewal says why."""
        self._end(job_id, f"job {job_id} was cancelled")

    def _end(self, job_id: str, why: str) -> None:
        with self._lock:
            self._live = {h for h in self._live if h.job_id != job_id}
            self._ended[job_id] = why

    def _refusal(self, hold: Hold, what: str) -> str:
        """'' while `hold` is live, else why a call about it is refused."""
        with self._lock:
            if hold in self._live:
                return ""
            ended = self._ended.get(hold.job_id)
        return (f"{what} from {hold.kind} {hold.token} refused: " +
                (ended or f"job {hold.job_id} is not held by this machine"))

    def renew(self, hold: Hold, phase: str, timeout_s: float) -> Renewal:
        why = self._refusal(hold, "renew")
        if not why:
            self.renewals.append(phase)
        return Renewal(not why, why, LEASE_S if not why else 0.0)

    def logs(self, hold: Hold, stream: str, seq: int, text: str) -> bool:
        if self._refusal(hold, "logs"):
            return False
        self.lines += [(stream, line) for line in text.splitlines()]
        return True

    def complete(self, hold: Hold, outcome: Outcome) -> Verdict:
        why = self._refusal(hold, "complete")
        if why:
            return Verdict(False, why)
        self.completed.append((hold.job_id, hold.token, outcome))
        self._end(hold.job_id, f"job {hold.job_id} is "
                               f"{'succeeded' if outcome.succeeded else 'failed'}")
        return Verdict(True)

    def release(self, hold: Hold, reason: str, failed: bool = False,
                cannot_run_here: bool = False) -> Verdict:
        why = self._refusal(hold, "release")
        if why:
            return Verdict(False, why)
        self.released.append((hold.job_id, hold.token, reason, failed))
        self._end(hold.job_id, f"job {hold.job_id} was handed back")
        return Verdict(True)

    def begin_checkpoint(self, hold: Hold, epoch: int, size: int) -> CheckpointUpload:
        why = self._refusal(hold, f"checkpoint of epoch {epoch}")
        return CheckpointUpload(False, why or "this fake keeps no checkpoints")

    def record_checkpoint(self, hold: Hold, rec: CheckpointRecord) -> Verdict:
        return Verdict(False, self._refusal(hold, "checkpoint") or "this fake keeps none")
