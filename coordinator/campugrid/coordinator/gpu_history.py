"""Each GPU's memory over the last day, by the minute: what its agent reported free (after
other processes and the owner's reserve) next to what the platform had reserved on it. One row
per GPU and minute, however often the agent reports; a day of rows at most."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import GpuReservation, GpuSample

KEEP_MINUTES = 24 * 60
MAX_GPUS = 16  # per machine: what an agent reports beyond this is not kept


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as its agent reports it."""

    uuid: str
    name: str
    shared: bool  # Apple unified memory: the system's memory, not the GPU's own
    total_mb: int
    free_mb: int


@dataclasses.dataclass(frozen=True)
class Sample:
    minute: int
    total_mb: int
    free_mb: int
    reserved_mb: int

    @property
    def outside_mb(self) -> int:
        """Held outside the platform: the owner's programs and the memory they keep free."""
        return max(0, self.total_mb - self.free_mb)

    @property
    def reserved_shown_mb(self) -> int:
        return min(self.reserved_mb, max(0, self.free_mb))

    @property
    def available_mb(self) -> int:
        return max(0, self.free_mb - self.reserved_mb)


@dataclasses.dataclass(frozen=True)
class GpuHistory:
    machine_id: str
    uuid: str
    name: str
    shared: bool
    samples: tuple[Sample, ...]  # oldest first


def this_minute() -> int:
    return int(time.time() // 60)


class GpuHistories:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._noted: dict[str, int] = {}  # machine id -> the minute of its last sample here

    def note(self, machine_id: str, gpus: Sequence[GpuMemory]) -> None:
        """Keep the first report of each minute: one write per machine and minute, whatever
        the agent's pace (heartbeats and lease requests both report)."""
        minute = this_minute()
        if gpus and self._noted.get(machine_id) != minute:
            self._noted[machine_id] = minute
            self.record(machine_id, gpus, minute)

    def record(self, machine_id: str, gpus: Sequence[GpuMemory], minute: int | None = None) -> None:
        """This minute's sample of each GPU (a second one in the same minute replaces it)."""
        minute = this_minute() if minute is None else minute
        gpus = gpus[:MAX_GPUS]
        if not gpus:
            return
        try:
            with self.db.tx() as s:
                reserved = {u: int(mb or 0) for u, mb in s.execute(
                    select(GpuReservation.gpu_uuid, func.sum(GpuReservation.memory_mb))
                    .where(GpuReservation.machine_id == machine_id)
                    .group_by(GpuReservation.gpu_uuid))}
                for g in gpus:
                    row = s.get(GpuSample, (machine_id, g.uuid, minute))
                    if row is None:
                        row = GpuSample(machine_id=machine_id, gpu_uuid=g.uuid, minute=minute)
                        s.add(row)
                    row.name, row.shared = g.name, g.shared
                    row.total_mb, row.free_mb = max(0, g.total_mb), max(0, g.free_mb)
                    row.reserved_mb = reserved.get(g.uuid, 0)
        except IntegrityError:
            pass  # another coordinator wrote this minute's sample first: it stands

    def since(self, minutes: int = 60, machine_ids: Sequence[str] | None = None) -> list[GpuHistory]:
        first = this_minute() - minutes + 1
        q = select(GpuSample).where(GpuSample.minute >= first)
        if machine_ids is not None:
            q = q.where(GpuSample.machine_id.in_(list(machine_ids)))
        q = q.order_by(GpuSample.machine_id, GpuSample.gpu_uuid, GpuSample.minute)
        out: dict[tuple[str, str], list[GpuSample]] = {}
        with self.db.read() as s:
            for row in s.scalars(q):
                out.setdefault((row.machine_id, row.gpu_uuid), []).append(row)
        return [GpuHistory(m, u, rows[-1].name, rows[-1].shared,
                           tuple(Sample(r.minute, r.total_mb, r.free_mb, r.reserved_mb)
                                 for r in rows))
                for (m, u), rows in out.items()]

    def prune(self, keep_minutes: int = KEEP_MINUTES) -> int:
        with self.db.tx() as s:
            res = s.execute(delete(GpuSample).where(GpuSample.minute < this_minute() - keep_minutes))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]
