"""Placement as pure functions: a snapshot of machines and GPUs in, a decision out.

`place` picks the GPUs of one machine for one job (the store commits it with a guarded
update, so a decision made on a stale snapshot simply fails and is retried); `why_waiting`
turns the same rules into the sentence a researcher sees while the job is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from campugrid.protocol.spec import LIMITS, Resources, limits_mask


@dataclasses.dataclass(frozen=True)
class GpuView:
    uuid: str
    kind: str  # "nvidia" | "apple"
    name: str
    free_mb: int  # as the agent measured it, minus the owner's reserve
    reserved_mb: int  # already promised to other attempts by the coordinator
    cc: tuple[int, int]

    @property
    def available_mb(self) -> int:
        return self.free_mb - self.reserved_mb


@dataclasses.dataclass(frozen=True)
class MachineView:
    id: str
    name: str
    gpus: tuple[GpuView, ...] = ()
    gpu_isolation: bool = False  # runsc can pass GPUs through (nvproxy)
    speed: float = 0.0  # GFLOP/s of the matmul benchmark the agent ran when it joined
    enforced: frozenset[str] = frozenset()  # the limits (spec.LIMITS) that hold on it
    shares: frozenset[str] = frozenset()  # the folders its owner shares (agent run --share)
    held: str = ""  # why its owner holds it (paused, a listed program runs); "" takes work
    # What one task can be given there (LeaseRequest, Capabilities); 0: not said (an older
    # agent), which places by GPUs and limits alone.
    cpus: float = 0.0
    memory_mb: int = 0
    disk_mb: int = 0
    busy: str = ""  # the job it runs now, an id's start ("" while it asks for work)
    busy_owner: str = ""  # the app whose job that is

    @property
    def lacks_mask(self) -> int:
        """The limits it cannot enforce, as a mask: a job needing any of them is not for it."""
        return limits_mask(set(LIMITS) - self.enforced)


# What a job may need of one machine, in the order a too-small one is told:
# (name, what the job asks, what the machine has).
def _sizes(need: Resources, m: MachineView) -> list[tuple[str, float, float]]:
    return [("CPUs", need.cpus, m.cpus), ("memory", need.memory_mb, m.memory_mb),
            ("disk", need.disk_needed_mb, m.disk_mb)]


@dataclasses.dataclass(frozen=True)
class Demand:
    """What a queued job needs of one machine, as the claim reads it (claims.queued_demand):
    the dispatcher claims only for machines that may hold some of what is queued."""

    limits: int  # spec.limits_mask of the limits it requires
    cpus: float
    memory_mb: int
    disk_mb: int
    gpus: int
    share: str | None


def may_hold(need: Demand, machine: MachineView) -> bool:
    """Whether a claim for this machine could take a job with this need: everything the claim
    checks but what only the database knows (its refusals, replicas kept apart, each GPU's
    memory and kind). A machine this says no to would get nothing from a claim."""
    return (need.limits & machine.lacks_mask == 0
            and all(not has or asked <= has for asked, has in (
                (need.cpus, machine.cpus), (need.memory_mb, machine.memory_mb),
                (need.disk_mb, machine.disk_mb)))
            and (need.gpus == 0 or (machine.gpu_isolation and len(machine.gpus) >= need.gpus))
            and (need.share is None or need.share in machine.shares))


def too_small(need: Resources, machine: MachineView) -> str:
    """What this machine has too little of for the job ("" if it can give it all)."""
    return next((name for name, asked, has in _sizes(need, machine) if has and asked > has), "")


def place(need: Resources, machine: MachineView) -> tuple[str, ...] | None:
    """The GPUs to reserve on `machine` (most available memory first), or None if it can't."""
    if need.gpus == 0:
        return ()
    if not machine.gpu_isolation:
        return None
    fits = sorted((g for g in machine.gpus if _suits(need, g)),
                  key=lambda g: (-g.available_mb, g.uuid))
    if len(fits) < need.gpus:
        return None
    return tuple(g.uuid for g in fits[:need.gpus])


def _suits(need: Resources, gpu: GpuView) -> bool:
    return (gpu.kind in need.gpu_kinds and gpu.cc >= need.min_cc
            and gpu.available_mb >= need.gpu_memory_mb)


def fast_from(online: Sequence[float]) -> float:
    """The speed from which a machine counts as fast: the upper median of the machines
    online. Fast machines take the heavy shards of a sharded job first, the others the light."""
    ranked = sorted(online)
    return ranked[len(ranked) // 2] if ranked else 0.0


def why_waiting(need: Resources, machines: Sequence[MachineView], share: str | None = None) -> str:
    """Why no online machine can take this job now, in words a researcher can act on."""
    if not machines:
        return "no approved machine online"
    free = [m for m in machines if not m.held]
    if not free:
        whys = sorted({m.held for m in machines})
        return (f"every approved machine online ({len(machines)}) is held by its owner now: "
                + "; ".join(whys[:3]) + ("; …" if len(whys) > 3 else ""))
    machines = free
    if share is not None:
        machines = [m for m in machines if share in m.shares]
        if not machines:
            return f"no online machine shares {share!r} (GET /v1/shares lists what is shared)"
    if need.require_limits:
        able = [m for m in machines if set(need.require_limits) <= m.enforced]
        if not able:
            lacking = sorted({name for m in machines for name in need.require_limits
                              if name not in m.enforced}, key=LIMITS.index)
            return (f"no online machine enforces {', '.join(lacking)} "
                    f"(resources.require_limits; {len(machines)} online)")
        machines = able
    big = [m for m in machines if not too_small(need, m)]
    if not big:
        return _too_small(need, machines)
    machines = big
    if need.gpus == 0:
        return _busy(machines)
    gpus = [(m, g) for m in machines for g in m.gpus]
    if not gpus:
        return f"no online machine has a GPU ({len(machines)} CPU-only online)"
    kinds = [(m, g) for m, g in gpus if g.kind in need.gpu_kinds]
    if not kinds:
        other = sorted({g.kind for _, g in gpus})
        if "apple" in other:
            return "not yet checked on Apple GPUs (add \"apple\" to resources.gpu_kinds)"
        return f"needs a GPU of kind {'/'.join(need.gpu_kinds)}; online: {', '.join(other)}"
    isolated = [(m, g) for m, g in kinds if m.gpu_isolation]
    if not isolated:
        return "no machine with a GPU can isolate it under gVisor (runsc nvproxy) right now"
    capable = [(m, g) for m, g in isolated if g.cc >= need.min_cc]
    if not capable:
        best = max(g.cc for _, g in isolated)
        return (f"needs compute capability ≥ {need.min_compute_capability} "
                f"(best online: {best[0]}.{best[1]})")
    roomy = [(m, g) for m, g in capable if g.available_mb >= need.gpu_memory_mb]
    if len({m.id for m, _ in roomy}) == 0 or not any(
            len([g for mm, g in roomy if mm.id == m.id]) >= need.gpus for m, _ in roomy):
        m, g = max(capable, key=lambda mg: mg[1].available_mb)
        count = f"{need.gpus} GPUs with " if need.gpus > 1 else ""
        return (f"no machine has {count}{_gb(need.gpu_memory_mb)} free "
                f"(most free: {m.name}, {_gb(max(0, g.available_mb))})")
    return _busy([m for m in machines if any(mm.id == m.id for mm, _ in roomy)])


def _too_small(need: Resources, machines: Sequence[MachineView]) -> str:
    """The resources no machine online has enough of, and the most one has."""
    sizes = [_sizes(need, m) for m in machines]
    whys = []
    for i, (name, asked, _) in enumerate(sizes[0]):
        has = [size[i][2] for size in sizes]
        if all(h and asked > h for h in has):
            one = "the one online machine has" if len(has) == 1 else "the largest online machine has"
            whys.append(f"needs {_amount(name, asked)}; {one} {_amount(name, max(has))}")
    if whys:
        return "; ".join(whys)
    # Each machine lacks something, but no one resource is short everywhere.
    return "no online machine has all of " + ", ".join(
        _amount(name, asked) for name, asked, _ in sizes[0])


def _busy(machines: Sequence[MachineView]) -> str:
    """Every machine that could take the job is at work (or about to ask for it)."""
    busy = [m for m in machines if m.busy]
    if len(busy) < len(machines):
        return "waiting for a machine that fits to ask for work"
    if len(busy) == 1:
        return (f"waiting for the one machine that fits ({busy[0].name}): busy with "
                f"{_job(busy[0].busy)}")
    shown = ", ".join(f"{m.name} with {_job(m.busy)}" for m in busy[:3])
    return (f"waiting for a free machine: the {len(busy)} that fit are busy ({shown}"
            + (", …)" if len(busy) > 3 else ")"))


OTHER_APPS = "*"  # MachineView.busy where the job is another app's (its id is not told)


def _job(busy: str) -> str:
    return "another app's job" if busy == OTHER_APPS else f"job {busy}"


def _amount(name: str, value: float) -> str:
    """'32 CPUs', '64 GB of memory', '2.5 GB of disk'."""
    if name == "CPUs":
        return f"{value:g} CPU" + ("" if value == 1 else "s")
    mb = int(value)
    size = (f"{mb / 1024:.0f} GB" if mb >= 10240 else f"{mb / 1024:.1f}".removesuffix(".0")
            + " GB" if mb >= 1024 else f"{mb} MB")
    return f"{size} of {name}"


def _gb(mb: int) -> str:
    return f"{mb / 1024:.0f} GB" if mb >= 1024 else f"{mb} MB"
