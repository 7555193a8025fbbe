"""Machines: registration, their credentials, heartbeats, and who is online."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import secrets
import uuid
from typing import Any

from sqlalchemy import func, select, update

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import GpuReservation, Machine
from campugrid.coordinator.scheduler import GpuView, MachineView
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import Unauthenticated
from campugrid.protocol.spec import ENFORCED


class Machines:
    def __init__(self, db: Database) -> None:
        self.db = db

    def register(self, name: str, capabilities: dict[str, Any]) -> tuple[str, str]:
        """A new machine: its id and its secret (only the secret's digest is kept)."""
        machine_id, secret = str(uuid.uuid4()), secrets.token_urlsafe(32)
        now = utcnow()
        with self.db.tx() as s:
            s.add(Machine(id=machine_id, name=name[:200], secret_sha256=_digest(secret),
                          capabilities_json=json.dumps(capabilities), registered_at=now,
                          last_seen_at=now))
        return machine_id, secret

    def authenticate(self, machine_id: str, secret: str) -> None:
        with self.db.read() as s:
            m = s.get(Machine, machine_id)
            # Compare digests in constant time; an unknown id costs the same as a wrong secret.
            expected = m.secret_sha256 if m is not None else _digest("")
            if not hmac.compare_digest(expected, _digest(secret)) or m is None:
                raise Unauthenticated("unknown machine or wrong secret; register again")

    def heartbeat(self, machine_id: str, capabilities: dict[str, Any] | None = None,
                  offer: MachineView | None = None) -> None:
        """The machine is alive; with what it reports now (capabilities, GPU snapshot)."""
        values: dict[str, Any] = {"last_seen_at": utcnow()}
        if capabilities is not None:
            values["capabilities_json"] = json.dumps(capabilities)
        if offer is not None:
            values["gpus_json"] = json.dumps({"isolation": offer.gpu_isolation, "gpus": [
                dataclasses.asdict(g) for g in offer.gpus]})
        with self.db.tx() as s:
            s.execute(update(Machine).where(Machine.id == machine_id).values(**values))

    def online(self, within_s: float = 30) -> list[MachineView]:
        """Machines seen recently, with their GPUs minus what is reserved on them."""
        since = utcnow() - dt.timedelta(seconds=within_s)
        with self.db.read() as s:
            reserved = {(m, g): int(mb) for m, g, mb in s.execute(
                select(GpuReservation.machine_id, GpuReservation.gpu_uuid,
                       func.sum(GpuReservation.memory_mb))
                .group_by(GpuReservation.machine_id, GpuReservation.gpu_uuid))}
            out = []
            for m in s.scalars(select(Machine).where(Machine.last_seen_at >= since)):
                snap = json.loads(m.gpus_json or "{}")
                snap = snap if isinstance(snap, dict) else {}  # "[]": never reported GPUs
                gpus = tuple(GpuView(g["uuid"], g["kind"], g["name"], g["free_mb"],
                                     reserved.get((m.id, g["uuid"]), 0), (g["cc"][0], g["cc"][1]))
                             for g in snap.get("gpus", []))
                caps = json.loads(m.capabilities_json or "{}")
                enforced = frozenset(name for name, how in (caps.get("limits") or {}).items()
                                     if how == ENFORCED)
                out.append(MachineView(m.id, m.name, gpus, bool(snap.get("isolation")),
                                       float(caps.get("speed_gflops") or 0.0), enforced))
            return out


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
