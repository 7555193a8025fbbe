"""Machines: who may work (register, approve, revoke), and how they are (heartbeats, what
they offer, their GPUs' memory)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from campugrid.coordinator.gpu_history import GpuHistory, GpuMemory
from campugrid.coordinator.machines import MachineRecord, MachineRecords, reported, said_digest
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.scheduler import MachineView
from campugrid.coordinator.store import Store
from campugrid.protocol.errors import Forbidden, InvalidInput

log = logging.getLogger("campugrid.coordinator")


class MachineService:
    def __init__(self, store: Store, requeue: Callable[[], list[str]]) -> None:
        """`requeue`: queue again the jobs whose lease ended (a revoked machine's, at once)."""
        self.store, self._requeue = store, requeue
        self._records = MachineRecords(store.machines)
        self._offers: dict[str, object] = {}
        self._offers_lock = threading.Lock()
        self.revoked: list[Callable[[str], None]] = []  # told of each revocation (the streams)

    def register(self, name: str, public_key: str, address: str = "") -> MachineRecord:
        """A machine for this key: new ones are pending until their owner approves them."""
        if not name or len(name) > 200:
            raise InvalidInput("name: 1 to 200 characters")
        record = self.store.machines.register(name, public_key, address)
        if record.status is MachineStatus.REVOKED:
            raise Forbidden(f"the key of machine {record.id} was revoked by its owner; join "
                            "with a new key (a new state folder) if that was a mistake")
        log.info("machine %s (%s) registered from %s: %s, fingerprint %s", record.id, name,
                 address or "?", record.status.value, record.fingerprint)
        return record

    def get(self, machine_id: str) -> MachineRecord:
        """The machine a call claims to be (its key and status; see MachineRecords)."""
        return self._records.get(machine_id)

    def known(self, machine_id: str) -> MachineRecord | None:
        """The record this process holds for the machine, however old (MachineRecords.known)."""
        return self._records.known(machine_id)

    def warm(self) -> int:
        """The records of the machines heard from lately, read at once (see MachineRecords)."""
        return self._records.warm()

    def recheck(self) -> None:
        """Statuses may have changed here (a quarantine): the next check reads them again."""
        self._records.recheck()

    def all(self) -> list[MachineRecord]:
        return self.store.machines.all()

    def online(self) -> list[MachineView]:
        """Approved machines heard from lately, with their GPUs and the job each one runs."""
        return self.store.machines.online()

    def names(self) -> dict[str, str]:
        """Every machine's name by its id (for pages that would otherwise show ids)."""
        return {m.id: m.name for m in self.store.machines.all()}

    def shared(self) -> dict[str, dict[tuple[str, int, str], int]]:
        return self.store.machines.shared()

    def approve(self, ref: str, owner: str | None = None) -> MachineRecord:
        """Approve (or reinstate) a machine; `owner` says whose it is: a verified job never
        takes two answers from machines of one owner."""
        if owner is not None:
            owner = owner.strip()
            if len(owner) > 200 or not owner.isprintable():
                raise InvalidInput("owner: at most 200 printable characters (whose machine "
                                   "it is, e.g. a name or an email address)")
        m = self.store.machines.set_status(self.store.machines.find(ref).id,
                                           MachineStatus.APPROVED, owner)
        self._records.forget(m.id)
        log.info("machine %s (%s, %s) approved", m.id, m.name, m.fingerprint)
        return m

    def revoke(self, ref: str) -> tuple[MachineRecord, list[str]]:
        """Revoke now: its leases end and its jobs go back to the queue at once."""
        m = self.store.machines.set_status(self.store.machines.find(ref).id,
                                           MachineStatus.REVOKED)
        self._records.forget(m.id)
        for listener in list(self.revoked):
            listener(m.id)
        requeued = self._requeue()
        log.warning("machine %s (%s) revoked; its jobs %s are queued again", m.id, m.name,
                    ", ".join(requeued) or "(none)")
        return m, requeued

    def heartbeat(self, machine_id: str, capabilities: dict[str, Any] | None,
                  offer: MachineView | None) -> None:
        self.store.machines.heartbeat(machine_id, capabilities, offer)
        if offer is not None:
            self._remember_offer(machine_id, offer)
            if capabilities is not None:
                self._records.heard(machine_id, said_digest(*reported(capabilities, offer)))

    def note_offer(self, machine_id: str, offer: MachineView) -> None:
        """Keep the machine's GPU snapshot (for why-it-waits) fresh: written when it changes,
        not once per ask for work (the agent's heartbeat, every 10 s, writes it too)."""
        if self._remember_offer(machine_id, offer):
            self.store.machines.heartbeat(machine_id, offer=offer)

    def _remember_offer(self, machine_id: str, offer: MachineView) -> bool:
        """Note what is stored now; False if it was stored already."""
        key = (offer.gpus, offer.gpu_isolation)
        with self._offers_lock:
            if self._offers.get(machine_id) == key:
                return False
            self._offers[machine_id] = key
            return True

    def note_memory(self, machine_id: str, gpus: Sequence[GpuMemory]) -> None:
        """For the console's memory chart: an approved machine's GPUs, as it reports them."""
        self.store.gpu_history.note(machine_id, gpus)

    def gpu_history(self, minutes: int) -> list[GpuHistory]:
        return self.store.gpu_history.since(minutes)
