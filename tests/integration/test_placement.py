"""GPU reservations in the store, on SQLite and PostgreSQL: taken with the lease in one step,
never promised twice (also from two coordinator processes at once), released on every end."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from campugrid.coordinator.scheduler import GpuView, MachineView, may_hold, why_waiting
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import utcnow
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.holds import attempt, session
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration
GB = 1024


def gpu_job(store: Store, gb: int, gpus: int = 1, **res) -> str:
    spec = JobSpec.from_dict({"resources": {"gpus": gpus, "gpu_memory_mb": gb * GB, **res}})
    return store.submit(spec, "contexts/x.tar", "ab" * 32)[0].id


def rig(machine_id: str, *free_gb: int, isolation: bool = True) -> MachineView:
    return MachineView(machine_id, "rig", tuple(
        GpuView(f"{machine_id}-gpu{i}", "nvidia", "RTX", gb * GB, 0, (8, 6))
        for i, gb in enumerate(free_gb)), isolation)


def test_a_gpu_job_reserves_memory_on_a_specific_gpu(store: Store):
    job = gpu_job(store, 10)
    m = add_machine(store, "rig", {})
    assert store.claim_next(m, 30, rig(m, 24)).id == job
    assert store.reserved_gpus(job, 1) == [f"{m}-gpu0"]
    assert "GPUs" in store.events(job)[-1].detail


def test_cpu_only_machines_never_get_gpu_jobs(store: Store):
    gpu_job(store, 1)
    cpu = add_machine(store, "laptop", {})
    assert store.claim_next(cpu, 30) is None
    assert store.claim_next(cpu, 30, rig(cpu, 24, isolation=False)) is None


def test_memory_is_never_promised_twice_under_concurrent_leases(store: Store):
    jobs = [gpu_job(store, 10) for _ in range(6)]
    m = add_machine(store, "rig", {})
    offer = rig(m, 24)  # room for two 10 GB jobs
    barrier = threading.Barrier(6)

    def go(_: int):
        barrier.wait()
        return store.claim_next(m, 30, offer)

    with ThreadPoolExecutor(6) as pool:
        got = [j.id for j in pool.map(go, range(6)) if j is not None]
    assert len(got) == 2 and len(set(got)) == 2 and set(got) <= set(jobs)
    # finishing one frees its memory for the next
    store.renew_lease(attempt(got[0], 1, m), JobState.RUNNING, 30)
    store.finish(attempt(got[0], 1, m), succeeded=True, exit_code=0, reason=None, result=None,
                 output_key=None, limits={})
    third = store.claim_next(m, 30, offer)
    assert third is not None and third.id not in got


@pytest.mark.parametrize("ending", ["cancel", "expire", "release"])
def test_every_ending_releases_the_reservation(store: Store, ending: str):
    job = gpu_job(store, 20)
    m = add_machine(store, "rig", {})
    store.claim_next(m, 30, rig(m, 24))
    other = gpu_job(store, 20)
    assert store.claim_next(m, 30, rig(m, 24)) is None  # full
    if ending == "cancel":
        store.cancel(job)
    elif ending == "expire":
        store.requeue_expired(utcnow() + dt.timedelta(seconds=60))
    else:
        store.release(attempt(job, 1, m), "drain")
    again = store.claim_next(m, 30, rig(m, 24))
    assert again is not None and again.id in (job, other)
    assert store.reserved_gpus(again.id, again.attempt) == [f"{m}-gpu0"]


def test_a_machine_that_reports_less_free_memory_gets_less(store: Store):
    gpu_job(store, 12)
    m = add_machine(store, "desktop", {})
    assert store.claim_next(m, 30, rig(m, 11)) is None  # a model server holds the rest


def test_why_a_job_waits_comes_from_online_machines(store: Store):
    m = add_machine(store, "desktop", {})
    store.machines.heartbeat(m, offer=rig(m, 2))
    [view] = store.machines.online()
    assert view.name == "desktop" and view.gpus[0].available_mb == 2 * GB


def needing(store: Store, *limits: str, **extra) -> str:
    spec = JobSpec.from_dict({"resources": {"require_limits": list(limits)}, **extra})
    return store.submit(spec, "contexts/x.tar", "ab" * 32)[0].id


def enforcing(machine_id: str, *limits: str, base: MachineView | None = None) -> MachineView:
    return dataclasses.replace(base or MachineView(machine_id, "m"), enforced=frozenset(limits))


@pytest.mark.parametrize("kind", ["plain", "sharded", "gpu"])
def test_a_job_goes_only_to_machines_that_enforce_what_it_requires(store: Store, kind: str):
    gpu = {"gpus": 1, "gpu_memory_mb": GB} if kind == "gpu" else {}
    sharded = {"command": ["true"], "shards": [{"payload": 1}]} if kind == "sharded" else {}
    strict = store.submit(JobSpec.from_dict({**sharded, "resources": {
        **gpu, "require_limits": ["build_disk"]}}), "contexts/x.tar", "ab" * 32)[0].id
    m = add_machine(store, "kaniko-box", {})
    lacks = enforcing(m, "memory", "cpu", "pids", "disk", "wall_time", "confinement",
                      "sandbox_seccomp", base=rig(m, 24) if gpu else None)
    assert store.claim_next(m, 30, lacks) is None
    # An offer that names no limit enforces none.
    assert store.claim_next(m, 30, rig(m, 24) if gpu else None) is None
    # A later job that requires nothing is not held up behind it.
    easy = store.submit(JobSpec.from_dict({"resources": gpu}), "contexts/x.tar", "cd" * 32)[0].id
    got = store.claim_next(m, 30, lacks)
    assert got is not None and got.id == easy
    other = add_machine(store, "buildah-box", {})
    got = store.claim_next(other, 30, enforcing(other, "build_disk", "memory",
                                                base=rig(other, 24) if gpu else None))
    assert got is not None and got.id == strict
    assert store.get(strict).spec.resources.require_limits == ("build_disk",)


def test_why_a_job_waits_names_the_limit_no_machine_enforces(store: Store):
    spec = JobSpec.from_dict({"resources": {"require_limits": ["sandbox_seccomp", "build_disk"]}})
    add_machine(store, "old-box", {"limits": {
        "memory": "enforced", "build_disk": "enforced",
        "sandbox_seccomp": "not enforced: no seccomp profile"}})
    [view] = store.machines.online()
    assert view.enforced == {"memory", "build_disk"}
    assert why_waiting(spec.resources, [view]) == (
        "no online machine enforces sandbox_seccomp (resources.require_limits; 1 online)")


SCRIPT = """
import json, sys, threading
from campugrid.coordinator.scheduler import GpuView, MachineView
from campugrid.coordinator.db import make_engine
from campugrid.coordinator.store import Store
url, machines = sys.argv[1], json.loads(sys.argv[2])
store = Store(make_engine(url))
got = []
def agent(m):
    offer = MachineView(m, m, (GpuView(m + "-gpu0", "nvidia", "RTX", 24 * 1024, 0, (8, 6)),), True)
    while True:
        job = store.claim_next(m, 60, offer)
        if job is None:
            return
        got.append((job.id, m))
threads = [threading.Thread(target=agent, args=(m,)) for m in machines]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got))
"""


def test_two_coordinator_processes_never_double_lease_or_overcommit(store: Store, db_url: str):
    jobs = [gpu_job(store, 10) for _ in range(40)]
    machines = [add_machine(store, f"m{i}", {}) for i in range(8)]
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, db_url, json.dumps(machines)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results += json.loads(out.strip().splitlines()[-1])
    leased = [job for job, _ in results]
    assert len(leased) == len(set(leased)) == 16  # 8 GPUs x 2 jobs of 10 GB in 24 GB
    assert set(leased) <= set(jobs)
    with store.engine.connect() as conn:
        per_gpu = conn.execute(text("SELECT gpu_uuid, SUM(memory_mb) FROM gpu_reservations "
                                    "GROUP BY gpu_uuid")).all()
    assert len(per_gpu) == 8 and all(total <= 24 * GB for _, total in per_gpu)


CPU_SCRIPT = """
import json, sys, threading
from campugrid.coordinator.db import make_engine
from campugrid.coordinator.store import Store
url, machines = sys.argv[1], json.loads(sys.argv[2])
store = Store(make_engine(url))
got = []
def agent(m):
    while True:
        job = store.claim_next(m, 60)
        if job is None:
            return
        got.append((job.id, job.attempt, m))
threads = [threading.Thread(target=agent, args=(m,)) for m in machines]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got))
"""


def test_two_coordinator_processes_lease_each_cpu_job_once(store: Store, db_url: str):
    # The one-statement claim (and on SQLite its DBAPI path), under real contention.
    jobs = [store.submit(JobSpec.from_dict({"command": ["x"]}), "contexts/x", "a" * 64)[0].id
            for _ in range(300)]
    machines = [add_machine(store, f"m{i}", {}) for i in range(8)]
    procs = [subprocess.Popen([sys.executable, "-c", CPU_SCRIPT, db_url, json.dumps(machines)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        results += json.loads(out.strip().splitlines()[-1])
    assert sorted(job for job, _, _ in results) == sorted(jobs)  # each exactly once
    assert {attempt for _, attempt, _ in results} == {1}
    assert all(store.get(j).state is JobState.BUILDING for j in jobs)


def share_job(store: Store, share: str = "imagenet") -> str:
    spec = JobSpec.from_dict({"datasets": [{"name": "d", "share": share,
                                            "sha256": {"val/x.jpg": "a" * 64}}]})
    return store.submit(spec, "contexts/x.tar", "ab" * 32)[0].id


def test_a_job_on_shared_files_goes_only_to_a_machine_that_shares_them(store: Store):
    needs = share_job(store)
    plain = store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)[0].id
    other = add_machine(store, "no-share", {})
    # The share job is older, but this machine does not share it: it gets the plain job.
    assert store.claim_next(other, 30, MachineView(other, "no-share")).id == plain
    assert store.claim_next(other, 30, MachineView(other, "no-share", shares=frozenset({"coco"}))) is None
    holder = add_machine(store, "holder", {})
    got = store.claim_next(holder, 30, MachineView(holder, "holder",
                                                   shares=frozenset({"coco", "imagenet"})))
    assert got is not None and got.id == needs


def test_a_machine_that_shares_still_takes_the_oldest_job_it_can(store: Store):
    plain = store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)[0].id
    needs = share_job(store)
    m = add_machine(store, "holder", {})
    offer = MachineView(m, "holder", shares=frozenset({"imagenet"}))
    assert [store.claim_next(m, 30, offer).id, store.claim_next(m, 30, offer).id] == [plain, needs]


def test_why_a_job_waits_names_the_share_no_machine_has(store: Store):
    add_machine(store, "box", {"shares": {"coco": [["a.jpg", 3, "b" * 64]]}})
    [view] = store.machines.online()
    assert view.shares == {"coco"}
    assert why_waiting(JobSpec().resources, [view], "imagenet") == (
        "no online machine shares 'imagenet' (GET /v1/shares lists what is shared)")
    assert store.machines.shared() == {"coco": {("a.jpg", 3, "b" * 64): 1}}


def sized(machine_id: str, cpus: float, memory_gb: int, disk_gb: int,
          base: MachineView | None = None) -> MachineView:
    return dataclasses.replace(base or MachineView(machine_id, "m"), cpus=cpus,
                               memory_mb=memory_gb * GB, disk_mb=disk_gb * GB)


@pytest.mark.parametrize("kind", ["plain", "sharded", "gpu", "share"])
@pytest.mark.parametrize("asks", [{"cpus": 32}, {"memory_mb": 64 * GB},
                                  {"output_mb": 100 * GB}, {"build_mb": 100 * GB}])
def test_a_job_goes_only_to_a_machine_that_can_give_what_it_asks(store: Store, kind: str,
                                                                  asks: dict):
    extra: dict = {
        "gpu": {"resources": {"gpus": 1, "gpu_memory_mb": GB}},
        "sharded": {"command": ["true"], "shards": [{"payload": 1}]},
        "share": {"datasets": [{"name": "d", "share": "imagenet",
                                "sha256": {"val/x.jpg": "a" * 64}}]}}.get(kind, {})
    res = {**extra.get("resources", {})}

    def submit(**more) -> str:
        spec = JobSpec.from_dict({**extra, "resources": {**res, **more}})
        return store.submit(spec, "contexts/x.tar", "ab" * 32)[0].id

    big = submit(**asks)
    small = submit()

    def offer(m: str, cpus: float, memory_gb: int, disk_gb: int) -> MachineView:
        base = rig(m, 24) if kind == "gpu" else MachineView(m, "m")
        if kind == "share":
            base = dataclasses.replace(base, shares=frozenset({"imagenet"}))
        return sized(m, cpus, memory_gb, disk_gb, base)

    laptop = add_machine(store, "laptop", {})
    # The older job is too big for this machine: it takes the one behind it, then nothing.
    got = store.claim_next(laptop, 30, offer(laptop, 2, 24, 32))
    assert got is not None and got.id == small
    assert store.claim_next(laptop, 30, offer(laptop, 2, 24, 32)) is None
    server = add_machine(store, "server", {})
    got = store.claim_next(server, 30, offer(server, 64, 256, 1024))
    assert got is not None and got.id == big


def test_a_machine_that_does_not_say_its_size_is_placed_as_before(store: Store):
    """An agent from before sizes were reported sends none (0): GPUs and limits decide."""
    big = store.submit(JobSpec.from_dict({"resources": {"cpus": 32, "memory_mb": 64 * GB}}),
                       "contexts/x.tar", "ab" * 32)[0].id
    m = add_machine(store, "old-agent", {})
    got = store.claim_next(m, 30, MachineView(m, "old-agent"))
    assert got is not None and got.id == big


def test_why_a_job_waits_names_the_resource_and_the_largest_machine(store: Store):
    add_machine(store, "laptop", {"cpus": 2, "memory_mb": 24 * GB - 300, "disk_mb": 30 * GB})
    add_machine(store, "desktop", {"cpus": 16, "memory_mb": 8 * GB, "disk_mb": 500 * GB})
    views = store.machines.online()
    assert {(v.name, v.cpus, v.disk_mb) for v in views} == {("laptop", 2, 30 * GB),
                                                             ("desktop", 16, 500 * GB)}
    huge = JobSpec.from_dict({"resources": {"memory_mb": 64 * GB}}).resources
    assert why_waiting(huge, views) == (
        "needs 64 GB of memory; the largest online machine has 24 GB of memory")
    both = JobSpec.from_dict({"resources": {"cpus": 32, "output_mb": 600 * GB}}).resources
    assert why_waiting(both, views) == (
        "needs 32 CPUs; the largest online machine has 16 CPUs; "
        "needs 600 GB of disk; the largest online machine has 500 GB of disk")
    # Each machine lacks one thing, but not the same one.
    mixed = JobSpec.from_dict({"resources": {"cpus": 4, "memory_mb": 16 * GB}}).resources
    assert why_waiting(mixed, views) == (
        "no online machine has all of 4 CPUs, 16 GB of memory, 4 GB of disk")


def test_a_busy_machine_is_online_and_the_queue_says_what_it_is_busy_with(store: Store):
    m = add_machine(store, "only-box", {"cpus": 2, "memory_mb": 4 * GB, "disk_mb": 30 * GB})
    running = store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)[0].id
    waiting = store.submit(JobSpec(), "contexts/x.tar", "cd" * 32)[0]
    assert store.claim_next(m, 30, sized(m, 2, 4, 30)).id == running
    [view] = store.machines.online()
    assert view.busy == running[:8]
    assert why_waiting(waiting.spec.resources, [view]) == (
        f"waiting for the one machine that fits (only-box): busy with job {running[:8]}")
    # To another app, the job it is busy with is not named.
    from campugrid.coordinator.waiting import waiting_reason

    theirs = store.submit(JobSpec(), "contexts/x.tar", "ef" * 32, owner="app-b")[0]
    assert waiting_reason(theirs, [view]) == (
        "waiting for the one machine that fits (only-box): busy with another app's job")
    assert waiting_reason(waiting, [view]).endswith(f"busy with job {running[:8]}")


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_machine_that_cannot_run_a_job_hands_it_back_and_is_never_offered_it_again(
        store: Store, kind: str):
    from campugrid.coordinator.waiting import waiting_reason

    sharded = {"command": ["true"], "shards": [{"payload": 1}]} if kind == "sharded" else {}
    job = store.submit(JobSpec.from_dict({**sharded, "max_attempts": 1}),
                       "contexts/x.tar", "ab" * 32)[0].id
    lacking = add_machine(store, "no-base", {})
    got = store.claim(lacking, 30, MachineView(lacking, "no-base"))
    assert got is not None and got.job.id == job
    why = "Dockerfile line 1: base image localhost/x:1 is not on this machine"
    if kind == "sharded":  # as Coordinator.release does it for a shard session
        store.refuse(job, lacking, why)
        store.shards.release(session(job, got.token, lacking), why, failed=False)
    else:
        store.release(attempt(job, got.token, lacking), why, cannot_run_here=True)
    view = store.get(job)
    assert view.state is JobState.QUEUED  # its only attempt is not used up
    assert store.claim_next(lacking, 30, MachineView(lacking, "no-base")) is None
    assert store.refusals([job]) == {job: {lacking: why}}
    [online] = store.machines.online()
    assert waiting_reason(view, [online], 0, store.refusals([job])[job]) == (
        f"every online machine said it cannot run this job (no-base: {why})")
    # An hour on, what the machine lacked may have been passing (a registry down): it is
    # offered the job again.
    from sqlalchemy import update

    from campugrid.coordinator.claims import REFUSAL_TTL_S
    from campugrid.coordinator.models import JobRefusal
    with store.db.tx() as s:
        s.execute(update(JobRefusal).values(
            at=utcnow() - dt.timedelta(seconds=REFUSAL_TTL_S + 1)))
    assert store.refusals([job]) == {}
    again = store.claim(lacking, 30, MachineView(lacking, "no-base"))
    assert again is not None and again.job.id == job
    if kind == "sharded":
        store.shards.release(session(job, again.token, lacking), why, failed=False)
    else:
        store.release(attempt(job, again.token, lacking), why, cannot_run_here=True)
    able = add_machine(store, "has-base", {})
    got = store.claim_next(able, 30, MachineView(able, "has-base"))
    assert got is not None and got.id == job


def test_with_no_machine_online_the_queue_says_the_approved_ones_areoffline_text(store: Store):
    from sqlalchemy import update

    from campugrid.coordinator.models import Machine
    from campugrid.coordinator.waiting import offline_text, waiting_reason

    view = store.submit(JobSpec(), "contexts/x.tar", "ab" * 32)[0]
    assert waiting_reason(view, [], 0, {}, offline_text(store.machines.all())) == (
        "no approved machine online")
    add_machine(store, "pending-box", {}, approve=False)
    gone = add_machine(store, "gamer-pc", {})
    with store.db.tx() as s:
        s.execute(update(Machine).where(Machine.id == gone)
                  .values(last_seen_at=utcnow() - dt.timedelta(minutes=7, seconds=5)))
    assert store.machines.online() == []
    assert waiting_reason(view, [], 0, {}, offline_text(store.machines.all())) == (
        "no approved machine online (1 approved, all offline; gamer-pc was last heard from "
        "7 min ago)")


# What the dispatcher reads before it claims (claims.queued_demand) and the check it makes in
# memory (scheduler.may_hold) against the claim itself: a machine the check passes over must
# be one the claim would give nothing, or a stream would wait while work it can hold is queued.
NEEDS = {
    "plain": {},
    "sharded": {"command": ["true"], "shards": [{"payload": 1}]},
    "cpus": {"resources": {"cpus": 8}},
    "memory": {"resources": {"memory_mb": 16 * GB}},
    "disk": {"resources": {"output_mb": 100 * GB}},
    "a limit": {"resources": {"require_limits": ["memory"]}},
    "a gpu": {"resources": {"gpus": 1, "gpu_memory_mb": GB}},
    "two gpus": {"resources": {"gpus": 2, "gpu_memory_mb": GB}},
    "a share": {"datasets": [{"name": "d", "share": "imagenet", "sha256": {"x.jpg": "a" * 64}}]},
}
OFFERS = {
    "laptop": lambda m: sized(m, 2, 4, 20),
    "server": lambda m: dataclasses.replace(sized(m, 32, 128, 1000),
                                            enforced=frozenset({"memory"})),
    "rig": lambda m: sized(m, 8, 32, 200, rig(m, 24)),
    "rig without isolation": lambda m: sized(m, 8, 32, 200, rig(m, 24, 24, isolation=False)),
    "two-gpu rig": lambda m: sized(m, 8, 32, 200, rig(m, 24, 24)),
    "sharer": lambda m: dataclasses.replace(sized(m, 8, 32, 200), shares=frozenset({"imagenet"})),
    "unsaid": lambda m: MachineView(m, "m"),  # an older agent: sizes not said
}


@pytest.mark.parametrize("need", sorted(NEEDS))
def test_the_dispatchers_check_passes_over_exactly_the_machines_a_claim_gives_nothing(
        store: Store, need: str):
    said, got = set(), set()
    for name, offer_of in OFFERS.items():
        store.submit(JobSpec.from_dict(NEEDS[need]), "contexts/x.tar", "ab" * 32)
        m = add_machine(store, name, {})
        offer = offer_of(m)
        demand = store.queued_demand(100)
        assert demand, "a queued job's need was not read"
        if any(may_hold(d, offer) for d in demand):
            said.add(name)
        if store.claim_next(m, 30, offer) is not None:
            got.add(name)
    assert said == got, (need, said, got)
    assert got and (need in ("plain", "sharded") or got != set(OFFERS)), "cases that decide nothing"
