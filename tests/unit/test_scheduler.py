"""Placement and the reasons a job waits: pure functions over synthetic machines."""

from __future__ import annotations

import random

from campugrid.coordinator.scheduler import GpuView, MachineView, place, why_waiting
from campugrid.protocol.spec import Resources, limits_mask

GB = 1024


def gpu(uuid: str, free_gb: float, *, kind: str = "nvidia", cc=(8, 6), reserved_gb: float = 0,
        name: str = "RTX 3090") -> GpuView:
    return GpuView(uuid, kind, name, int(free_gb * GB), int(reserved_gb * GB), cc)


def need(gpus: int = 1, gb: float = 12, cc: str | None = None, kinds=("nvidia",)) -> Resources:
    return Resources(gpus=gpus, gpu_memory_mb=int(gb * GB), min_compute_capability=cc,
                     gpu_kinds=tuple(kinds))


def test_cpu_jobs_fit_anywhere():
    assert place(Resources(), MachineView("m", "laptop")) == ()


def test_gpu_memory_already_promised_is_not_offered_twice():
    m = MachineView("m", "desktop", (gpu("g0", 24, reserved_gb=16),), gpu_isolation=True)
    assert place(need(gb=8), m) == ("g0",)
    assert place(need(gb=9), m) is None


def test_the_gpus_with_most_room_are_chosen():
    m = MachineView("m", "rig", (gpu("a", 10), gpu("b", 40), gpu("c", 20)), gpu_isolation=True)
    assert place(need(gpus=2, gb=10), m) == ("b", "c")
    assert place(need(gpus=4, gb=1), m) is None


def test_no_gpu_job_goes_where_gvisor_cannot_isolate_the_gpu():
    m = MachineView("m", "desktop", (gpu("g0", 24),), gpu_isolation=False)
    assert place(need(gb=1), m) is None
    assert "isolate" in why_waiting(need(gb=1), [m])


def test_compute_capability_and_kinds_are_respected():
    old = MachineView("m", "old", (gpu("g0", 24, cc=(7, 5)),), gpu_isolation=True)
    assert place(need(gb=1, cc="8.0"), old) is None
    assert why_waiting(need(gb=1, cc="8.0"), [old]) == "needs compute capability ≥ 8.0 (best online: 7.5)"
    mac = MachineView("mac", "mac-studio", (gpu("apple0", 64, kind="apple", cc=(0, 0)),), gpu_isolation=True)
    assert place(need(gb=1), mac) is None
    assert why_waiting(need(gb=1), [mac]).startswith("not yet checked on Apple GPUs")
    assert place(need(gb=1, kinds=("nvidia", "apple")), mac) == ("apple0",)


def test_reasons_name_the_best_machine():
    desktop = MachineView("d", "desktop", (gpu("g0", 24, reserved_gb=22),), gpu_isolation=True)
    laptop = MachineView("l", "laptop", (gpu("g1", 1),), gpu_isolation=True)
    assert why_waiting(need(gb=12), [desktop, laptop]) == "no machine has 12 GB free (most free: desktop, 2 GB)"
    assert why_waiting(need(gb=12), []) == "no approved machine online"
    assert why_waiting(need(gb=12), [MachineView("c", "nas")]).startswith("no online machine has a GPU")


def test_a_required_limit_narrows_the_machines_the_reason_speaks_of():
    strict = Resources(gpus=1, gpu_memory_mb=12 * GB, require_limits=("memory", "build_disk"))
    old = MachineView("o", "old", (gpu("g0", 48),), gpu_isolation=True, enforced=frozenset({"memory"}))
    new = MachineView("n", "new", (gpu("g1", 4),), gpu_isolation=True,
                      enforced=frozenset({"memory", "build_disk"}))
    assert why_waiting(strict, [old]) == (
        "no online machine enforces build_disk (resources.require_limits; 1 online)")
    # The roomy machine does not count: only the one that enforces both is spoken of.
    assert why_waiting(strict, [old, new]) == "no machine has 12 GB free (most free: new, 4 GB)"
    assert old.lacks_mask & limits_mask(strict.require_limits)
    assert not new.lacks_mask & limits_mask(strict.require_limits)


def test_placement_over_thousands_of_machines_is_quick_and_never_overcommits():
    rng = random.Random(7)
    machines = [MachineView(f"m{i}", f"m{i}", tuple(gpu(f"m{i}g{j}", rng.choice([8, 12, 24, 48]))
                                                    for j in range(rng.randint(0, 4))), True)
                for i in range(5000)]
    reserved: dict[str, int] = {}

    placed = 0
    for m in machines:
        view = MachineView(m.id, m.name, tuple(GpuView(g.uuid, g.kind, g.name, g.free_mb,
                                                       reserved.get(g.uuid, 0), g.cc) for g in m.gpus), True)
        for _ in range(3):
            chosen = place(need(gb=10), view)
            if not chosen:
                break
            for uuid in chosen:
                reserved[uuid] = reserved.get(uuid, 0) + 10 * GB
            placed += 1
            view = MachineView(view.id, view.name, tuple(
                GpuView(g.uuid, g.kind, g.name, g.free_mb, reserved.get(g.uuid, 0), g.cc)
                for g in view.gpus), True)
    assert placed > 1000
    free = {g.uuid: g.free_mb for m in machines for g in m.gpus}
    assert all(reserved[u] <= free[u] for u in reserved)


def test_the_faster_half_takes_heavy_shards():
    from campugrid.coordinator.scheduler import fast_from

    online = [400.0, 10.0, 200.0, 50.0]
    assert [s >= fast_from(online) for s in online] == [True, False, True, False]
    assert fast_from([10.0, 50.0, 200.0]) == 50.0  # odd count: the middle one is fast
    assert fast_from([5.0]) <= 5.0  # alone: the fastest there is
    assert fast_from([]) == 0.0


def test_machines_their_owners_hold_are_not_counted_as_free():
    paused = MachineView("m1", "gamer-pc", held="its owner paused the machine (campugrid provider pause)")
    playing = MachineView("m2", "studio", held="its owner's program blender started")
    assert why_waiting(Resources(), [paused, playing]) == (
        "every approved machine online (2) is held by its owner now: its owner paused the machine "
        "(campugrid provider pause); its owner's program blender started")
    # one machine that takes work: the reason is about that one
    assert why_waiting(Resources(), [paused, MachineView("m3", "nas", busy="ab12cd34")]) == (
        "waiting for the one machine that fits (nas): busy with job ab12cd34")
    assert why_waiting(need(gb=1), [paused, MachineView("m3", "nas")]).startswith("no online machine has a GPU (1 ")
