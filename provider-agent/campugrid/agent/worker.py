"""The agent's loop: register, heartbeat, pull one task at a time, run it, repeat.

SIGTERM drains: the running job gets SIGTERM inside its sandbox and a grace period to take
a final checkpoint, which is uploaded before the task is handed back (not counted as a
failed attempt). A second signal stops it at once. The owner drains the same way, without
stopping the agent (campugrid.agent.owner): the machine is theirs first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from campugrid.agent import gpus, metrics, speed
from campugrid.agent.client import CoordinatorApi, CoordinatorClient, fetch_membership
from campugrid.agent.gpus import GpuPolicy
from campugrid.agent.images import ImageCache
from campugrid.agent.install import scope_of
from campugrid.agent.messages import Capabilities, Lease, Room
from campugrid.agent.owner import Owner, OwnerPolicy
from campugrid.agent.shards import ShardSessionTask
from campugrid.agent.shares import Shares
from campugrid.agent.status import StatusFile
from campugrid.agent.task import Task, job_image_prefix, machine_cpus
from campugrid.builders.base import Builder
from campugrid.protocol import logs
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.spec import ENFORCED
from campugrid.sandbox import confine, slots
from campugrid.sandbox import limits as host_limits
from campugrid.sandbox.runtime import Runtime

log = logging.getLogger("campugrid.agent")
OWNER_POLL_S = 0.5  # how often the owner's say is checked: drains start within this
# An idle agent waits this long at a time on its stream for the lease the coordinator sends
# when work comes (link.Waiting). Heartbeats, sent between two waits (and during a task),
# stay within HEARTBEAT_S plus this of each other: inside the 30 s in which the coordinator
# counts a machine online.
LEASE_WAIT_S = 8.0
HEARTBEAT_S = 10.0
MAX_POLL_S = 3600.0  # the longest wait between two asks for work that --poll-seconds takes


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    coordinator: str
    state_dir: Path
    name: str
    # The shortest time between two waits for work (`--poll-seconds`; an idle agent waits on
    # its stream meanwhile); a machine not approved yet asks again after twice that.
    poll_seconds: float = 1.0
    drain_grace_seconds: float = 30.0
    gpu_policy: GpuPolicy = dataclasses.field(default_factory=GpuPolicy)
    # The provider's policy: limits this machine must enforce, or the agent does not start.
    require_limits: tuple[str, ...] = ()
    # The coordinator certificate's fingerprint: joins (or re-joins) with it; empty: use the
    # membership `campugrid agent join` stored in state_dir.
    pin: str = ""
    # Folders the owner shares with jobs (`--share NAME=/path`): name -> folder.
    shares: dict[str, Path] = dataclasses.field(default_factory=dict)
    # When work is allowed and which programs take the machine back (campugrid.agent.owner).
    owner: OwnerPolicy = dataclasses.field(default_factory=OwnerPolicy)
    # /metrics on 127.0.0.1 (campugrid.agent.metrics); 0: not served.
    metrics_port: int = 0
    # Images shared through the coordinator's registry are kept here for later tasks of the
    # same build, up to this many MB (`--image-cache-mb`); 0: never pull, always build here.
    image_cache_mb: int = 20480
    # Where builds' connections go (agent/buildnet.py: "platform", "local" or "none").
    build_network: str = "platform"

    def __post_init__(self) -> None:
        check_poll_seconds(self.poll_seconds)


def check_poll_seconds(seconds: float) -> None:
    if not 0 < seconds <= MAX_POLL_S:  # NaN fails this too
        raise CampugridError(f"--poll-seconds {seconds}: must be a number of seconds above 0 "
                             f"and at most {MAX_POLL_S:.0f}")


class Agent:
    def __init__(self, settings: AgentSettings, builder: Builder, sandbox: Runtime) -> None:
        if os.geteuid() == 0:
            raise CampugridError("the agent never runs as root: start it as an unprivileged "
                                 "user (infra/setup.sh creates 'campugrid')")
        self.settings = settings
        self.builder = builder
        self.sandbox = sandbox
        # Everything this agent makes (job cgroups, job images) is named under its scope, so
        # its sweeps remove its own leftovers and never another agent's of the same user.
        self.scope = scope_of(settings.state_dir)
        self.sandbox.scope = self.builder.scope = self.scope
        # The output slot is this agent's for its lifetime (released when it exits).
        self.slot, output = slots.acquire()
        self.limits = enforceable(sandbox, builder, output)
        for name in settings.require_limits:
            how = self.limits.get(name)
            if how is None:
                raise CampugridError(f"--require-limits {name}: no such limit (known: "
                                     f"{', '.join(sorted(self.limits))})")
            if how != ENFORCED:
                raise CampugridError(f"this machine cannot enforce {name} ({how}), which the "
                                     "provider's policy requires (--require-limits)")
        self.enforced = sorted(name for name, how in self.limits.items() if how == ENFORCED)
        self.client = CoordinatorApi(CoordinatorClient(fetch_membership(
            settings.state_dir, settings.coordinator, settings.pin)))
        self.work_root = settings.state_dir / "work"
        self.images = (ImageCache(settings.state_dir, self.scope, sandbox.ops,
                                  max_mb=settings.image_cache_mb)
                       if settings.image_cache_mb > 0 else None)
        self.shares = Shares(settings.shares)
        self.stopping = threading.Event()
        self.task: Task | None = None
        self.job_images = JobImages(sandbox)
        self.revoked = False  # its owner revoked this machine: run() returned for good
        self.gpu_note = sandbox.gpu_isolation_note()
        self.gpu_isolation = not self.gpu_note
        metrics.METRICS.gpus.policy = settings.gpu_policy
        self.speed = speed.in_child(gpu=bool(gpus.discover(settings.gpu_policy).gpus))
        log.info("speed score: %.1f GFLOP/s (matmul)", self.speed)
        self.owner = Owner(settings.state_dir, settings.owner, nvml=_nvml())
        self.held = ""  # why the owner holds the machine now; "" while it takes work
        self.last_beat = 0.0  # when the coordinator last heard from it (time.monotonic)
        self.idle_room: Room | None = None  # what one task could have, measured between tasks
        self.status = StatusFile(settings.state_dir, name=settings.name,
                                 coordinator=self.client.wire.membership.coordinator,
                                 fingerprint=self.client.wire.fingerprint,
                                 limits=self.limits, hours=str(settings.owner.hours or ""),
                                 programs=list(settings.owner.programs))

    def shutdown(self) -> None:
        """First call: drain the running task. Second call: stop it now."""
        if self.stopping.is_set() and self.task is not None:
            self.task.stop.set()
            return
        self.stopping.set()
        if self.task is not None:
            log.info("draining task %s (grace %.0f s)", self.task.lease.job_id,
                     self.settings.drain_grace_seconds)
            self.task.drain(self.settings.drain_grace_seconds)

    def room(self) -> Room:
        """What one task can be given here: the machine's CPUs and memory, and the output
        slot's room (without one, the free space where tasks' files go)."""
        mem_kb = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        if self.slot is not None:
            disk = self.slot.capacity()
        else:
            disk = shutil.disk_usage(self.settings.state_dir).free
        return Room(cpus=machine_cpus(), memory_mb=mem_kb // 1024, disk_mb=disk // 2**20)

    def capabilities(self) -> Capabilities:
        found = gpus.discover(self.settings.gpu_policy)
        note = "; ".join(n for n in (found.note, self.gpu_note if found.gpus else "") if n)
        # While a task runs, what the machine offers is what it had before (its disk is in use).
        room = self.idle_room if self.task is not None and self.idle_room else self.room()
        return Capabilities(runtime=self.sandbox.describe(), builder=self.builder.name,
                            cpus=room.cpus, memory_mb=room.memory_mb, disk_mb=room.disk_mb,
                            limits=self.limits, gpus=found.gpus,
                            gpu_isolation=self.gpu_isolation and bool(found.gpus),
                            gpu_note=note, speed_gflops=self.speed,
                            shares=self.shares.listing(), held=self.held)

    def beat(self, *, every_s: float = HEARTBEAT_S) -> None:
        """Tell the coordinator this machine is alive, and what it has now, at most every
        `every_s`: between asks for work, and from the owner's watcher while a task runs (a
        busy machine is not an offline one). RpcError from the call."""
        if time.monotonic() - self.last_beat > every_s:
            self.last_beat = time.monotonic()
            self.client.heartbeat(self.capabilities())

    def run(self, *, once: bool = False) -> None:
        served = self._serve_metrics()
        try:
            self._run(once=once)
        finally:
            self.job_images.retry()
            if served is not None:
                served.stop()

    def _serve_metrics(self) -> metrics.MetricsServer | None:
        """/metrics on the loopback address; a port already taken costs the metrics only."""
        if not self.settings.metrics_port:
            return None
        try:
            served = metrics.serve(self.settings.state_dir, self.settings.metrics_port)
        except CampugridError as e:
            log.warning("%s; the agent runs without /metrics", e)
            return None
        log.info("metrics on http://127.0.0.1:%d/metrics, to the token that `campugrid provider "
                 "metrics-token` prints", served.port)
        return served

    def _run(self, *, once: bool) -> None:
        caps = self.capabilities()
        while not self.stopping.is_set():
            try:
                self.client.ensure_registered(self.settings.name, caps)
                break
            except grpc.RpcError as e:
                log.warning("cannot reach the coordinator at %s (%s); retrying",
                            self.settings.coordinator, e.code())
                self.stopping.wait(2)
        log.info("agent %s registered as %s (key fingerprint %s)", self.settings.name,
                 self.client.machine_id, self.client.wire.fingerprint)
        self.status.update(machine_id=self.client.machine_id)
        logs.thread(self._watch_owner, name="owner").start()
        logs.thread(self._beat_while_busy, name="heartbeat").start()
        for name in self.sandbox.sweep(self.client.machine_id):
            log.warning("removed sandbox %s left from an earlier run of this agent", name)
        self.sweep("an earlier run of this agent", logging.WARNING)
        if self.images is not None and self.images.available:
            for image in self.images.sweep_unknown():
                log.warning("removed image %s, which the image cache had lost track of", image)
        told_pending = 0.0
        while not self.stopping.is_set():
            held = self.owner.hold()
            self._heed(held)
            try:
                self.beat()
                if held:
                    self.job_images.retry()
                    self.stopping.wait(OWNER_POLL_S)
                    continue
                offer = gpus.discover(self.settings.gpu_policy).gpus
                asked = time.monotonic()
                lease = self.client.lease(offer, self.gpu_isolation and bool(offer),
                                          self.enforced, self.shares.names(), LEASE_WAIT_S,
                                          give_up=lambda: self.stopping.is_set() or
                                          bool(self.owner.hold()), room=self._idle_room())
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.PERMISSION_DENIED and "revoked" in str(e.details()):
                    log.error("%s; the agent stops", e.details())
                    self.revoked = True
                    return
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                    if time.monotonic() - told_pending > 60:
                        log.warning("waiting for approval: %s", e.details())
                        told_pending = time.monotonic()
                    self.stopping.wait(2 * self.settings.poll_seconds)
                    continue
                log.warning("coordinator unreachable (%s)", e.code())
                self.stopping.wait(2)
                continue
            if lease is None:  # the wait on the stream counts as the wait between two asks
                self.job_images.retry()
                self.stopping.wait(self.settings.poll_seconds - (time.monotonic() - asked))
                continue
            self.run_task(lease)
            if once:
                return

    def _heed(self, held: str) -> None:
        """Note why the owner holds the machine now ("": it takes work); the next heartbeat,
        sent at once, tells the coordinator."""
        if held != self.held:
            log.info("the owner holds this machine: %s", held or "no more; taking work again")
            self.held = held
            self.status.update(held=held)
            self.last_beat = 0.0  # the coordinator hears of it now, not in 10 s

    def _idle_room(self) -> Room:
        self.idle_room = self.room()
        return self.idle_room

    def _beat_while_busy(self) -> None:
        """While a task runs, the heartbeats go on (between tasks the main loop sends them):
        a busy machine is not an offline one. Its own thread: a slow coordinator holds up
        nothing else."""
        while not self.stopping.wait(1.0):
            task = self.task
            if task is None:
                continue
            try:
                self.beat()
            except grpc.RpcError as e:
                log.debug("heartbeat during task %s: %s", task.lease.job_id, e.code())

    def _watch_owner(self) -> None:
        """Drain the running task as soon as the owner wants the machine back."""
        while not self.stopping.wait(OWNER_POLL_S):
            task = self.task
            if task is None or task.handover:
                continue
            why = self.owner.drain_reason(task.lease.gpu_uuids, _members(self.sandbox, task.name))
            if why and self.task is task:
                log.info("%s: handing task %s back (grace %.0f s)", why, task.lease.job_id,
                         self.settings.owner.grace_seconds)
                # The coordinator hears of the hold before the hand-back: the job it queues
                # again is not offered back here, and its waiting reason names the hold.
                self._heed(self.owner.hold())
                try:
                    self.beat()
                except grpc.RpcError as e:
                    log.debug("heartbeat before the hand-back: %s", e.code())
                task.drain(self.settings.owner.grace_seconds, why)

    def run_task(self, lease: Lease) -> None:
        log.info("task %s (%s %d) leased", lease.job_id, lease.hold_kind, lease.fencing_token)
        work = self.work_root / f"{lease.job_id}-{lease.fencing_token}"
        slots.remove_tree(work)
        work.mkdir(parents=True)
        kind = ShardSessionTask if lease.shard is not None else Task
        try:
            # Every line the task logs (and its threads, started with logs.thread) names it.
            with logs.about_job(lease.job_id, lease.fencing_token):
                self.task = kind(self.client, lease, work, self.builder, self.sandbox,
                                 self.settings.gpu_policy, self.slot, self.shares, self.images,
                                 build_network=self.settings.build_network)
                self.status.task_started(lease.job_id, lease.fencing_token)
                metrics.METRICS.gpus.hold(lease.gpu_uuids, lease.gpu_memory_mb)
                if self.stopping.is_set():  # a drain arrived between lease and start
                    self.task.drain(0)
                elif held := self.owner.hold():  # the owner came back as the lease came
                    self.task.drain(0, f"{held}: handed back as it was leased")
                self.task.run()
        except grpc.RpcError as e:
            log.warning("task %s: the coordinator did not take the report (%s); its lease will "
                        "expire and the job will run again", lease.job_id, e.code())
        finally:
            metrics.METRICS.gpus.hold((), 0)
            if self.task is not None:  # None: it failed before it was made, and never started
                self.status.task_ended(self.task.ended)
            ended = self.task.tag if self.task is not None else ""
            self.task = None
            self.sweep(f"task {lease.job_id}", logging.INFO, ended)

    def sweep(self, whose: str, level: int, ended: str = "") -> None:
        """Between tasks nothing of a task may remain: its cgroups (and whatever still runs in
        them, e.g. a build runtime's last `runsc delete`), its work folder, its image
        (`ended`: JobImages). Without `ended` (at start, or after a task that was never made)
        every job image of this agent goes: an earlier life's leftovers."""
        for name in host_limits.sweep(self.sandbox.limits, self.scope):
            log.log(level, "removed cgroup %s left by %s", name, whose)
        images = (self.job_images.ended(ended) if ended else
                  self.sandbox.sweep_images(job_image_prefix(self.scope)))
        for image in images:
            log.log(level, "removed image %s left by %s", image, whose)
        for folder in sorted(self.work_root.glob("*")) if self.work_root.is_dir() else []:
            slots.remove_tree(folder)
            log.log(level, "removed work folder %s left by %s", folder.name, whose)
        for path in self.slot.leftovers() if self.slot is not None else []:
            slots.remove_tree(path)
            log.log(level, "removed %s from output slot %s, left by %s", path.name,
                    path.parent, whose)


class JobImages:
    """Job images this agent has yet to remove. A task's image goes as its task ends (the
    agent's sweep); one whose removal the store lock put off (store_lock), or that the store
    could not be asked to remove, is tried again at the next task's end, while the agent waits
    idle or its owner holds the machine, and as it stops. (Until 2026-12-07 a task's image
    stayed until the next task had ended: sandboxes ran `--userns keep-id`, for which Podman
    wrote an ID-mapped copy of the whole image at its first start and deleted it with the
    image, and the next job of the same context found the copy there. Without the copy,
    keeping it changes nothing that bench/turns.py can measure.)"""

    def __init__(self, sandbox: Runtime) -> None:
        self.sandbox = sandbox
        self.left: set[str] = set()  # removals put off

    def ended(self, image: str) -> list[str]:
        """`image`'s task has ended: remove it, and those put off before; returns the latter
        that are now gone."""
        return self._remove({image} - {""})

    def retry(self) -> list[str]:
        """Try again the removals put off."""
        return self._remove(set())

    def _remove(self, names: set[str]) -> list[str]:
        names = names | self.left
        removed = {name for name in names if self._removed(name)}
        earlier = sorted(self.left & removed)
        self.left = names - removed
        return earlier

    def _removed(self, name: str) -> bool:
        """Whether `name` is gone now; a store that cannot be asked (Podman's service gone,
        a command that hung) leaves it for the next time, as a busy store lock does."""
        try:
            return self.sandbox.remove_image(name)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("cannot remove image %s now (%s); it is tried again later", name, e)
            return False


def enforceable(sandbox: Runtime, builder: Builder, output: str) -> dict[str, str]:
    """Every limit this machine can or cannot enforce, as reported to the coordinator:
    the sandbox's, the build's disk, the confinement of untrusted bytes, and how /output is
    bounded (`output`, from slots.acquire)."""
    can = builder.capabilities()
    build_disk = (f"not enforced: the {builder.name} builder has no bounded build store"
                  if not can.bounded_store else ENFORCED
                  if can.bounded_without_slot or output == ENFORCED else
                  f"not enforced: the {builder.name} builder is bounded on an output slot only, "
                  "and this agent holds none")
    layers = confine.layers()
    missing = [f"{name} {how}" for name, how in layers.items() if not how.startswith(ENFORCED)]
    seccomp = (ENFORCED if sandbox.seccomp else
               "not enforced: no seccomp profile; only gVisor's own checks apply")
    return {**sandbox.limits.as_dict(), "build_disk": build_disk,
            "confinement": "; ".join(missing) if missing else ENFORCED,
            "sandbox_seccomp": seccomp, "output": output}


def _members(sandbox: Runtime, name: str) -> Callable[[int], bool]:
    """Whether a pid is one of the sandbox's host processes: the runtime is asked once, and
    only if something (NVML showing a process on the job's GPUs) needs to know."""
    found: list[frozenset[int]] = []

    def ours(pid: int) -> bool:
        if not found:
            found.append(sandbox.processes(name))
        return pid in found[0]
    return ours


def _nvml() -> Any:
    """NVML (nvidia-ml-py) where a driver answers, for the owner's watch over lent GPUs."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        nvml.nvmlShutdown()
    except Exception:  # no driver, no library: no GPU to watch
        return None
    return nvml
