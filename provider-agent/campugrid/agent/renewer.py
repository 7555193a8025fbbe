"""Keeps a task's lease alive, and fences the task when the lease is gone.

Self-fencing: if no renewal succeeded for a whole lease period, another machine may already
hold the job, so the task is stopped here rather than computing beside its replacement.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from campugrid.agent.client import CoordinatorApi
from campugrid.agent.messages import Lease
from campugrid.protocol import logs

log = logging.getLogger("campugrid.agent")
FENCE_AT = 0.75  # of a lease: with renewals every quarter, two may fail before fencing
# After a failed renewal that moved the client on to another coordinator, the next one goes
# there soon: waiting a whole quarter would spend the margin on one bad answer. (Against the
# same coordinator, the quarter: no faster retries at one that is overloaded.)
RETRY_S = 0.5


class Renewer:
    def __init__(self, client: CoordinatorApi, lease: Lease,
                 on_lost: Callable[[str], None]) -> None:
        self.client, self.lease, self.on_lost = client, lease, on_lost
        self.phase = "building"
        self.reason = ""
        self.lease_s = lease.lease_seconds or 12.0
        self.valid_from = time.monotonic()  # the lease was granted no earlier than now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = logs.thread(self._loop, name=f"renew-{lease.job_id}")

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        """Tell the coordinator now (the renewal carries the phase), not at the next tick."""
        self.phase = phase
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=15)

    def _lost(self, reason: str) -> None:
        if self.reason:
            return
        self.reason = reason
        log.warning("%s: stopping: %s", self.lease.job_id, reason)
        self.on_lost(reason)

    def renew_now(self) -> None:
        """One renewal from the caller's thread (e.g. to report a phase change at once)."""
        with contextlib.suppress(grpc.RpcError):
            self._renew_once()

    def _renew_once(self) -> bool:
        """True if the lease was extended; calls on_lost when the coordinator says stop."""
        sent = time.monotonic()
        reply = self.client.renew(self.lease.hold, self.phase,
                                  timeout_s=self.lease_s / 4)
        if not reply.keep_going:
            self._lost(reply.reason)
            return False
        with self._lock:
            self.valid_from = max(self.valid_from, sent)
        self.lease_s = reply.lease_seconds or self.lease_s
        return True

    def _loop(self) -> None:
        # The coordinator's lease runs from when it handled our renewal, which is no earlier
        # than when we sent it: fencing at sent + FENCE_AT * lease stops the sandbox before
        # the job can be leased elsewhere, with margin for clock rates and the reaper.
        pause = self.lease_s / 4
        while True:
            self._wake.wait(pause)
            self._wake.clear()
            if self._stop.is_set() or self.reason:
                return
            pause = self.lease_s / 4
            sent_to = self.client.address
            try:
                if not self._renew_once():
                    return
            except grpc.RpcError as e:
                if time.monotonic() - self.valid_from >= FENCE_AT * self.lease_s:
                    self._lost(f"self-fenced: no lease renewal for "
                               f"{time.monotonic() - self.valid_from:.0f} s ({e.code()})")
                    return
                if self.client.address != sent_to:
                    pause = min(RETRY_S, pause)
