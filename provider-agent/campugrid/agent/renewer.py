"""Keeps a task's lease alive, and fences the task when the lease is gone.

Self-fencing: if no renewal succeeded for a whole lease period, another machine may already
hold the job, so the task is stopped here rather than computing beside its replacement.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from campugrid.agent.client import CoordinatorClient
from campugrid.protocol import agent_pb2 as pb

log = logging.getLogger("campugrid.agent")


class Renewer:
    def __init__(self, client: CoordinatorClient, lease: pb.LeaseReply,
                 on_lost: Callable[[str], None]) -> None:
        self.client, self.lease, self.on_lost = client, lease, on_lost
        self.phase = "building"
        self.reason = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"renew-{lease.job_id}")

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
        self.reason = reason
        log.warning("%s: stopping: %s", self.lease.job_id, reason)
        self.on_lost(reason)

    def _loop(self) -> None:
        lease_s = self.lease.lease_seconds or 12.0
        last_ok = time.monotonic()
        while True:
            self._wake.wait(lease_s / 4)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                reply = self.client.renew(self.lease.job_id, self.lease.fencing_token, self.phase,
                                          timeout_s=lease_s / 4)
            except grpc.RpcError as e:
                if time.monotonic() - last_ok >= lease_s:
                    self._lost(f"self-fenced: no lease renewal for {lease_s:.0f} s ({e.code()})")
                    return
                continue
            if not reply.keep_going:
                self._lost(reply.reason)
                return
            last_ok = time.monotonic()
            lease_s = reply.lease_seconds or lease_s
