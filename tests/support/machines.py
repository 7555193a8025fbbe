"""Machines for store tests: each with a key of its own, approved by its owner."""

from __future__ import annotations

from typing import Any

from campugrid.coordinator.machines import Status
from campugrid.coordinator.store import Store
from campugrid.protocol import keys


def add_machine(store: Store, name: str, capabilities: dict[str, Any] | None = None, *,
                approve: bool = True, address: str = "") -> str:
    key = keys.Ed25519PrivateKey.generate()
    record = store.machines.register(name, keys.public_text(key), address)
    if approve:
        store.machines.set_status(record.id, Status.APPROVED)
    store.machines.heartbeat(record.id, capabilities or {})
    return record.id
