"""Machines: their keys, their owner's approval, heartbeats, and who is online.

A machine registers with a public key it made itself and waits as **pending** until its owner
compares the fingerprint and approves it; only **approved** machines get work, URLs or data.
A **revoked** machine is refused everything from then on. The coordinator keeps no secret of
any machine: its calls are checked against the public key alone.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import (
    FleetProcess,
    GpuReservation,
    Job,
    Machine,
    MachineEpoch,
    ShardSession,
)
from campugrid.coordinator.scheduler import GpuView, MachineView
from campugrid.coordinator.views import utcnow
from campugrid.protocol import keys
from campugrid.protocol.errors import Forbidden, InvalidInput, NotFound, Unauthenticated
from campugrid.protocol.spec import ENFORCED
from campugrid.protocol.states import ACTIVE

PENDING_TTL_S = 7 * 24 * 3600  # a machine nobody approved in a week is forgotten


class Status(enum.StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REVOKED = "revoked"
    # It answered against a quorum of other machines (verified.py): no work until an admin
    # reinstates it (approve) or revokes it.
    QUARANTINED = "quarantined"


@dataclasses.dataclass(frozen=True)
class MachineRecord:
    id: str
    name: str
    fingerprint: str
    status: Status
    public_key: str
    address: str
    registered_at: dt.datetime
    last_seen_at: dt.datetime
    held: str = ""  # why its owner holds it now, as its last heartbeat said
    # What one task can be given there, as its last heartbeat said (0: not said).
    cpus: int = 0
    memory_mb: int = 0
    disk_mb: int = 0
    # Its record against quorums (verified.py), and why it is quarantined ("" if it is not).
    agreed: int = 0
    disagreed: int = 0
    streak: int = 0
    quarantine: str = ""
    owner: str = ""  # whose machine it is, as the admin who approved it said
    runtime: str = ""  # its sandbox runtime as it said (`runsc <version>`, with its date)
    said: str = ""  # what its last heartbeat with capabilities stored (said_digest)

    @classmethod
    def from_row(cls, m: Machine) -> MachineRecord:
        caps = json.loads(m.capabilities_json or "{}")
        caps = caps if isinstance(caps, dict) else {}
        return cls(m.id, m.name, m.fingerprint, Status(m.status), m.public_key, m.address,
                   m.registered_at, m.seen_at, str(caps.get("held") or ""),
                   int(caps.get("cpus") or 0), int(caps.get("memory_mb") or 0),
                   int(caps.get("disk_mb") or 0), m.agreed or 0, m.disagreed or 0,
                   m.streak or 0, m.quarantine or "", m.owner or "",
                   str(caps.get("runtime") or "")[:100],
                   said_digest(m.capabilities_json or "", m.gpus_json or ""))


def reported(capabilities: dict[str, Any], offer: MachineView) -> tuple[str, str]:
    """The machine's columns a heartbeat with capabilities writes: capabilities_json and
    gpus_json."""
    return json.dumps(capabilities), gpus_json(offer)


def gpus_json(offer: MachineView) -> str:
    """The machine's GPU snapshot as its gpus_json column keeps it."""
    return json.dumps({"isolation": offer.gpu_isolation,
                       "gpus": [dataclasses.asdict(g) for g in offer.gpus]})


def _speed(capabilities: Any) -> float:
    """A machine's matmul score (GFLOP/s) as its stored capabilities say; 0 if they do not."""
    return float(capabilities.get("speed_gflops") or 0.0) if isinstance(capabilities, dict) else 0.0


def said_digest(capabilities_json: str, gpus_json: str) -> str:
    """Names what a heartbeat stored, to tell whether the next one says anything new."""
    return hashlib.sha256(f"{capabilities_json}\0{gpus_json}".encode()).hexdigest()


class Machines:
    def __init__(self, db: Database) -> None:
        self.db = db

    def register(self, name: str, public_key: str, address: str = "") -> MachineRecord:
        """A new pending machine for this key; the same key again is the same machine."""
        key = keys.parse_public(public_key)
        pub = keys.public_text(key)
        now = utcnow()
        with self.db.tx() as s:
            known = s.scalars(select(Machine).where(Machine.public_key == pub)).one_or_none()
            if known is not None:
                return MachineRecord.from_row(known)
            row = Machine(id=str(uuid.uuid4()), name=name[:200], public_key=pub,
                          fingerprint=keys.key_fingerprint(key),
                          status=Status.PENDING.value, address=address[:100],
                          capabilities_json="{}", registered_at=now, last_seen_at=now)
            s.add(row)
            s.flush()
            s.refresh(row, ["seen_at"])
        return MachineRecord.from_row(row)

    def get(self, machine_id: str) -> MachineRecord:
        with self.db.read() as s:
            m = s.get(Machine, machine_id) if _is_uuid(machine_id) else None
            if m is None:
                raise Unauthenticated(f"unknown machine {machine_id[:40]!r}; join again with "
                                      "`campugrid agent join`")
            return MachineRecord.from_row(m)

    def find(self, ref: str) -> MachineRecord:
        """A machine by id, unique id prefix (at least 6), fingerprint or name, for its owner."""
        ref = ref.strip()
        with self.db.read() as s:
            match = [Machine.id == ref, Machine.fingerprint == ref, Machine.name == ref]
            if len(ref) >= 6:
                match.append(Machine.id.startswith(ref, autoescape=True))
            q = select(Machine).where(or_(*match))
            found = list(s.scalars(q.limit(3)))
        if not found:
            raise NotFound(f"no machine {ref!r} (see `campugrid machines`)")
        if len(found) > 1:
            raise InvalidInput(f"{ref!r} names {len(found)} machines; give the machine id")
        return MachineRecord.from_row(found[0])

    def all(self) -> list[MachineRecord]:
        with self.db.read() as s:
            return [MachineRecord.from_row(m)
                    for m in s.scalars(select(Machine).order_by(Machine.registered_at))]

    def set_status(self, machine_id: str, status: Status,
                   owner: str | None = None) -> MachineRecord:
        """Approve (with whose machine it is, if `owner` is said), reinstate or revoke."""
        with self.db.tx() as s:
            m = s.get(Machine, machine_id)
            if m is None:
                raise NotFound(f"no machine {machine_id!r}")
            if m.status == Status.REVOKED.value and status is not Status.REVOKED:
                raise Forbidden(f"machine {machine_id} was revoked; it can only join again "
                                "with a new key")
            m.status = status.value
            if owner is not None:
                m.owner = owner
            if status is Status.APPROVED:
                m.quarantine = None  # reinstated: it earns trust again from nothing
            bump_epoch(s)
            if status is Status.REVOKED:
                end_leases(s, machine_id)
            return MachineRecord.from_row(m)

    def expire_pending(self, older_than_s: float = PENDING_TTL_S) -> int:
        since = utcnow() - dt.timedelta(seconds=older_than_s)
        with self.db.tx() as s:
            res = s.execute(delete(Machine).where(Machine.status == Status.PENDING.value,
                                                  Machine.registered_at < since))
            gone = int(res.rowcount or 0)  # type: ignore[attr-defined]
            if gone:
                bump_epoch(s)
            return gone

    def epoch(self) -> int:
        """How many times any machine's status changed (see MachineEpoch)."""
        with self.db.read() as s:
            return int(s.scalar(select(MachineEpoch.epoch).where(MachineEpoch.id == 1)) or 0)

    def heartbeat(self, machine_id: str, capabilities: dict[str, Any] | None = None,
                  offer: MachineView | None = None) -> None:
        """The machine is alive; with what it reports now (capabilities, GPU snapshot)."""
        values: dict[str, Any] = {"last_seen_at": utcnow()}
        if capabilities is not None:
            values["capabilities_json"] = json.dumps(capabilities)
        if offer is not None:
            values["gpus_json"] = gpus_json(offer)
        with self.db.tx() as s:
            s.execute(update(Machine).where(Machine.id == machine_id).values(**values))

    def seen_since(self, since: dt.datetime, limit: int) -> list[MachineRecord]:
        """The machines heard from since `since`, the latest first, at most `limit`."""
        with self.db.read() as s:
            return [MachineRecord.from_row(m) for m in s.scalars(
                select(Machine).where(Machine.seen_at >= since)
                .order_by(Machine.seen_at.desc()).limit(limit))]

    def alive(self, process: str, changed: dict[str, bool], chunk: int = 10_000) -> None:
        """This coordinator process is alive now: the machines connected on its streams are
        seen as long as it says so (Machine.seen_at). `changed`: the machines that connected
        to it (True) or left it (False) since it last said it; one statement for up to
        `chunk` of each (SQLite takes 32,766 values in one statement). A machine that left
        is written only if it has not connected to another process meanwhile."""
        now = utcnow()
        joined = [m for m, connected in changed.items() if connected]
        left = [m for m, connected in changed.items() if not connected]
        with self.db.tx(durable=False) as s:
            if not s.execute(update(FleetProcess).where(FleetProcess.id == process)
                             .values(alive_at=now)).rowcount:  # type: ignore[attr-defined]
                # Its first word: the rows of processes long gone go, theirs is made.
                s.execute(delete(FleetProcess).where(
                    FleetProcess.alive_at < now - dt.timedelta(days=1)))
                s.add(FleetProcess(id=process, alive_at=now))
            for i in range(0, len(left), chunk):
                s.execute(update(Machine).where(Machine.id.in_(left[i:i + chunk]),
                                                Machine.connected_to == process)
                          .values(connected_to=None, last_seen_at=now))
            for i in range(0, len(joined), chunk):
                s.execute(update(Machine).where(Machine.id.in_(joined[i:i + chunk]))
                          .values(connected_to=process, last_seen_at=now))

    def not_approved(self, machine_ids: Sequence[str], chunk: int = 10_000) -> list[str]:
        """Those of these machines that may no longer work (revoked, quarantined, gone)."""
        approved: set[str] = set()
        with self.db.read() as s:
            for i in range(0, len(machine_ids), chunk):
                approved.update(s.scalars(select(Machine.id).where(
                    Machine.id.in_(machine_ids[i:i + chunk]),
                    Machine.status == Status.APPROVED.value)))
        return [m for m in machine_ids if m not in approved]

    def online(self, within_s: float = 30) -> list[MachineView]:
        """Approved machines seen recently, with their GPUs minus what is reserved on them,
        and the job each one runs now."""
        since = utcnow() - dt.timedelta(seconds=within_s)
        with self.db.read() as s:
            busy = {m: (j, o) for m, j, o in s.execute(
                select(Job.machine_id, Job.id, Job.owner_id)
                .where(Job.state.in_([x.value for x in ACTIVE])))}
            busy.update((m, (j, o)) for m, j, o in s.execute(
                select(ShardSession.machine_id, ShardSession.job_id, Job.owner_id)
                .join(Job, Job.id == ShardSession.job_id)
                .where(ShardSession.active.is_(True))))
            reserved = {(m, g): int(mb) for m, g, mb in s.execute(
                select(GpuReservation.machine_id, GpuReservation.gpu_uuid,
                       func.sum(GpuReservation.memory_mb))
                .group_by(GpuReservation.machine_id, GpuReservation.gpu_uuid))}
            out = []
            for m in s.scalars(select(Machine).where(Machine.seen_at >= since,
                                                     Machine.status == Status.APPROVED.value)):
                snap = json.loads(m.gpus_json or "{}")
                snap = snap if isinstance(snap, dict) else {}  # "[]": never reported GPUs
                gpus = tuple(GpuView(g["uuid"], g["kind"], g["name"], g["free_mb"],
                                     reserved.get((m.id, g["uuid"]), 0), (g["cc"][0], g["cc"][1]))
                             for g in snap.get("gpus", []))
                caps = json.loads(m.capabilities_json or "{}")
                enforced = frozenset(name for name, how in (caps.get("limits") or {}).items()
                                     if how == ENFORCED)
                shares = caps.get("shares") or {}
                out.append(MachineView(m.id, m.name, gpus, bool(snap.get("isolation")),
                                       _speed(caps), enforced,
                                       frozenset(shares) if isinstance(shares, dict) else frozenset(),
                                       str(caps.get("held") or ""),
                                       cpus=float(caps.get("cpus") or 0),
                                       memory_mb=int(caps.get("memory_mb") or 0),
                                       disk_mb=int(caps.get("disk_mb") or 0),
                                       busy=busy.get(m.id, ("", ""))[0][:8],
                                       busy_owner=busy.get(m.id, ("", ""))[1] or ""))
            return out

    def speeds(self, within_s: float = 30, only: str | None = None) -> dict[str, float]:
        """The matmul score (GFLOP/s) of each approved machine seen recently, as `online`
        reads them, without the rest of their records; or of `only` that machine, whenever
        it was seen."""
        since = utcnow() - dt.timedelta(seconds=within_s)
        query = select(Machine.id, Machine.capabilities_json).where(
            Machine.status == Status.APPROVED.value)
        query = query.where(Machine.id == only) if only is not None else query.where(
            Machine.seen_at >= since)
        out = {}
        with self.db.read() as s:
            for machine_id, caps_json in s.execute(query):
                out[machine_id] = _speed(json.loads(caps_json or "{}"))
        return out

    def shared(self, within_s: float = 30) -> dict[str, dict[tuple[str, int, str], int]]:
        """What approved machines online share: share -> (path, size, sha256) -> how many
        machines have that file. Paths are inside the share; host paths are never reported."""
        since = utcnow() - dt.timedelta(seconds=within_s)
        out: dict[str, dict[tuple[str, int, str], int]] = {}
        with self.db.read() as s:
            for caps_json in s.scalars(select(Machine.capabilities_json).where(
                    Machine.seen_at >= since, Machine.status == Status.APPROVED.value)):
                shares = (json.loads(caps_json or "{}").get("shares") or {})
                for name, files in (shares.items() if isinstance(shares, dict) else ()):
                    seen = out.setdefault(name, {})
                    for path, size, sha in files:
                        seen[(path, size, sha)] = seen.get((path, size, sha), 0) + 1
        return out

    def pending_online(self, within_s: float = 30) -> int:
        since = utcnow() - dt.timedelta(seconds=within_s)
        with self.db.read() as s:
            return int(s.scalar(select(func.count()).select_from(Machine).where(
                Machine.seen_at >= since, Machine.status == Status.PENDING.value)) or 0)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def end_leases(s: Session, machine_id: str) -> None:
    """End the machine's leases now: the reaper (or the caller) requeues them at once."""
    past = utcnow() - dt.timedelta(seconds=1)
    s.execute(update(Job).where(Job.machine_id == machine_id,
                                Job.state.in_([x.value for x in ACTIVE]))
              .values(lease_expires_at=past).execution_options(synchronize_session=False))
    s.execute(update(ShardSession).where(ShardSession.machine_id == machine_id,
                                         ShardSession.active.is_(True))
              .values(lease_expires_at=past).execution_options(synchronize_session=False))


def bump_epoch(s: Session) -> None:
    s.execute(update(MachineEpoch).where(MachineEpoch.id == 1)
              .values(epoch=MachineEpoch.epoch + 1))


MACHINE_CACHE_S = 1.0  # how old a machine's key and status may be when a call is checked
MACHINE_RECORD_S = 300.0  # a record is read again this often even if no status changed


class MachineRecords:
    """What a coordinator process remembers of the machines calling it. Changes made here
    apply at once (`forget`); those made by another process within MACHINE_CACHE_S, when
    this process next reads the machine status epoch and every record read under an older
    one is read again (a revoked machine's leases end at the revocation anyway, so its calls
    are refused as stale). One small read a second, whatever the number of machines."""

    def __init__(self, machines: Machines) -> None:
        self.machines = machines
        # id -> (record, good until, the status epoch known when it was read)
        self._records: dict[str, tuple[MachineRecord, float, int]] = {}
        self._epoch: tuple[int, float] = (-1, 0.0)  # the status epoch, and when it was read

    def get(self, machine_id: str) -> MachineRecord:
        now = time.monotonic()
        epoch, read_at = self._epoch
        if now - read_at > MACHINE_CACHE_S:
            epoch = self.machines.epoch()
            self._epoch = (epoch, now)
        hit = self._records.get(machine_id)
        # A record read under an older epoch may predate the change: read it again.
        if hit is not None and hit[1] > now and hit[2] == epoch:
            return hit[0]
        record = self.machines.get(machine_id)
        if len(self._records) > 100_000:
            self._records.clear()
        self._records[machine_id] = (record, now + MACHINE_RECORD_S, epoch)
        return record

    def warm(self, within_s: float = MACHINE_RECORD_S, limit: int = 20_000) -> int:
        """Read at once the records of the machines heard from within `within_s` (at a
        start: those about to connect again, thousands at once after a restart, would each
        read their own). How many were read."""
        epoch = self.machines.epoch()
        records = self.machines.seen_since(utcnow() - dt.timedelta(seconds=within_s), limit)
        now = time.monotonic()
        self._epoch = (epoch, now)
        for record in records:
            self._records[record.id] = (record, now + MACHINE_RECORD_S, epoch)
        return len(records)

    def known(self, machine_id: str) -> MachineRecord | None:
        """The record held for this machine, however old; None if none is (no read)."""
        hit = self._records.get(machine_id)
        return hit[0] if hit is not None else None

    def forget(self, machine_id: str) -> None:
        self._records.pop(machine_id, None)

    def heard(self, machine_id: str, said: str) -> None:
        """What this machine's heartbeat just stored (its record's `said`), if it is held."""
        hit = self._records.get(machine_id)
        if hit is not None:
            self._records[machine_id] = (dataclasses.replace(hit[0], said=said), hit[1], hit[2])

    def recheck(self) -> None:
        """Read the status epoch at the next call: a status may have changed in this
        process's own transaction (a quarantine) that no `forget` names."""
        self._epoch = (-1, 0.0)
