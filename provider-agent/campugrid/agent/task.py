"""One leased task on this machine, from download to report. Its life (`Stage`), and how it
ends (`Ending`):

    PREPARING   the context (unpacked confined), datasets, the checkpoint to resume, bases
        |
    BUILDING    the image: pulled from another machine's build, or built here (RUN steps in
        |       gVisor) and shared (images.ImageJob)
        |
    RUNNING     the sandbox runs the job; checkpoints go up as they appear (a sharded job's
        |       session serves shards instead: shards.py, through `execute`)
        |
    REPORTING   the last checkpoint pass, /output uploaded, then one of:
        |         REPORTED          Complete: succeeded, or failed by the job's own doing
        |         HANDED_BACK       Release: drained (the owner, a shutdown) or its GPU filled
        |         CANNOT_RUN_HERE   Release: a base this machine lacks, too little disk
        |         FAILED_HERE       Release: this machine failed (the attempt counts)
        |         LOST              nothing: the lease is gone (renewals refused)
    ENDED       the image, the work folder and the slot are cleaned up

Any stage may end early: `stop` (set by a drain's grace period, the lease's loss, the disk
watchdog) ends the build or the sandbox; `handover` says why the task goes back unfinished.
Nothing from the job ever runs outside gVisor: this only moves files and drives the builder
and the sandbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import httpx

from campugrid import hooks
from campugrid.agent import bases as remote_bases
from campugrid.agent import buildnet, checkpoints, gpus, images, sandboxing, transfers
from campugrid.agent.client import CoordinatorApi
from campugrid.agent.gpus import GpuPolicy
from campugrid.agent.images import ImageCache
from campugrid.agent.logship import LogShipper
from campugrid.agent.messages import Lease, Outcome
from campugrid.agent.metrics import METRICS
from campugrid.agent.renewer import Renewer
from campugrid.agent.sandboxing import Mapped
from campugrid.agent.shares import Shares
from campugrid.builders.base import Builder
from campugrid.buildpolicy.dockerfiles import BaseUse, allowed_bases, pin_bases
from campugrid.buildpolicy.tarballs import extract_context_file
from campugrid.protocol import logs
from campugrid.protocol.errors import (
    BuildFailed,
    CampugridError,
    CannotRunHere,
    InvalidInput,
    SandboxError,
)
from campugrid.protocol.spec import BUILD_MB, ENFORCED, JobSpec
from campugrid.sandbox import confine, slots
from campugrid.sandbox.podman_ops import PodmanOps
from campugrid.sandbox.runtime import RunRequest, Runtime

log = logging.getLogger("campugrid.agent")
BUILD_TIMEOUT_S = 1800
DISK_POLL_S = 0.25
R = TypeVar("R")


def machine_cpus() -> int:
    """The CPUs this machine offers (its capabilities say so to the coordinator)."""
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """What a build here works from: the unpacked context, its FROM lines, the bases pulled
    for it (their local names), the checked uses, its disk, and its log."""

    context_dir: Path
    froms: Sequence[tuple[int, int]]
    local: dict[BaseUse, str]
    uses: Sequence[BaseUse]
    disk_mb: int
    log: Callable[[str], None]


def build_cpus(asked: float) -> float:
    """A build may use every CPU the machine offers: the machine holds this one task while
    it builds, and a job could ask for them all for its run anyway. The run is held to what
    the job asked (resources.cpus)."""
    return max(asked, float(machine_cpus()))


class Stage(enum.Enum):
    """Where a task is in its life (the module's diagram)."""

    PREPARING = "preparing"
    BUILDING = "building"
    RUNNING = "running"
    REPORTING = "reporting"
    ENDED = "ended"

    @property
    def phase(self) -> str:
        """What renewals tell the coordinator: the job is building, or it runs."""
        return "running" if self in (Stage.RUNNING, Stage.REPORTING) else "building"


class Ending(enum.Enum):
    """How a task ends, and so what the coordinator is told (the module's diagram)."""

    REPORTED = "reported"
    HANDED_BACK = "handed back"
    CANNOT_RUN_HERE = "cannot run here"
    FAILED_HERE = "failed on this machine"
    LOST = "stopped"


class Task:
    """A leased task's life. Subclasses (shards.ShardSessionTask) extend it through `execute`
    (what runs once the image is there: `prepare`, then the sandbox) and `drain`."""

    # The push of a build for other machines goes on beside the job (images.obtain's
    # `later`): this task's lease lasts until it reports, so the push is recorded under it.
    push_beside = True

    def __init__(self, client: CoordinatorApi, lease: Lease, work: Path,
                 builder: Builder, sandbox: Runtime, gpu_policy: GpuPolicy = GpuPolicy(),
                 slot: slots.Slot | None = None, shares: Shares | None = None,
                 cache: ImageCache | None = None, build_network: str = "platform") -> None:
        self.client, self.lease, self.work = client, lease, work
        self.build_network = build_network  # this machine's (agent/buildnet.py MODES)
        self.cache = cache  # images shared through the registry (None: always build here)
        self.shares = shares or Shares({})
        self.builder, self.sandbox = builder, sandbox
        self.spec = JobSpec.from_json(lease.spec_json)
        # /output and /checkpoints: in the agent's output slot, which the kernel bounds to
        # output_mb, where there is one that can hold it; else in the work folder.
        self.slot: slots.Slot | None = None
        self.files = work
        if slot is not None:
            try:
                self.files, self.slot = slot.prepare(self.spec.resources.output_mb * 1024**2), slot
            except (SandboxError, OSError) as e:
                log.warning("task %s: the output slot cannot be used (%s); /output is only "
                            "checked every %.2f s", lease.job_id, e, DISK_POLL_S)
        # spec.checkpoints.dir (own_dir) is writable in the read-only image, in the same room
        self.output_dir, self.ckpt_dir, self.own_dir = sandboxing.folders(self.files)
        self.name = f"campugrid-{lease.job_id}-{lease.fencing_token}"
        # What a build here is tagged; the image that runs may be a cached or pulled one.
        self.tag = f"{job_image_prefix(sandbox.scope)}{lease.job_id}:{lease.fencing_token}"
        self.image = self.tag
        self.user = images.task_user(lease)  # what it uses of the image cache
        self.sharing: threading.Thread | None = None  # the push of this task's build
        self.stage = Stage.PREPARING
        self.stop = threading.Event()  # stop building/running now (any thread may set it)
        self.lost = threading.Event()  # the lease is gone: report nothing
        self.ran = threading.Event()  # the sandbox has exited (the disk watchdog stops)
        # Why the task goes back unfinished ("": it does not), as the coordinator records the
        # hand-over: a drain (the owner, a shutdown), or its GPU filled up before the start.
        self.handover = ""
        self.disk_exceeded = False  # the disk watchdog stopped the job
        self.resumed: int | None = None  # the epoch put in /checkpoints to resume from
        self.ended = "running"  # how it ended, in words (for the owner's provider status)
        self.gpu_policy = gpu_policy
        self.renewer = Renewer(client, lease, on_lost=self._on_lost)
        self.shipper = LogShipper(client, lease.hold)
        self.uploader = checkpoints.CheckpointUploader(client, lease.hold, self.ckpt_dir, work,
                                                       on_recorded=self.renewer.renew_now)

    def _on_lost(self, reason: str) -> None:
        self.lost.set()
        self.stop.set()

    def hand_over(self, why: str) -> None:
        """The task goes back unfinished, `why` (the first reason given stands)."""
        self.handover = self.handover or why

    def enter(self, stage: Stage) -> None:
        """Move on to `stage`; the coordinator hears at once when the phase it sees changes."""
        changed = stage.phase != self.stage.phase
        self.stage = stage
        if changed:
            self.renewer.set_phase(stage.phase)

    def drain(self, grace_s: float, why: str = "the provider is shutting down") -> None:
        """Ask the job to stop (SIGTERM inside the sandbox); kill it after the grace period.
        The task is then handed back, `why`, without costing the job an attempt."""
        self.hand_over(why)
        if self.stage is not Stage.RUNNING:
            self.stop.set()
            return
        self.sandbox.signal(self.name, "TERM")
        timer = threading.Timer(grace_s, self.stop.set)
        timer.daemon = True
        timer.start()

    def _watch_disk(self, folders: tuple[Path, ...]) -> None:
        """Stop the job once /output, /checkpoints and its own checkpoint folder hold more than
        output_mb. In an output slot the kernel refuses the bytes past it, and this stops the
        job that hit the wall; without one, this is the bound (a single file cannot pass the
        limit: RLIMIT_FSIZE, see run_request). Apparent sizes count too: sparse files would
        inflate the output tarball."""
        limit = self.spec.resources.output_mb * 1024 * 1024
        while not self.stop.wait(DISK_POLL_S) and not self.ran.is_set():
            used = sandboxing.bytes_in(folders)
            if self.slot is not None:
                used = max(used, self.slot.used())
            if used > limit:
                self.disk_exceeded = True
                # At once: a clean stop takes a second in which the job goes on writing.
                self.sandbox.kill(self.name)
                self.stop.set()
                return

    def _check_gpus(self) -> Mapped:
        """Re-check free memory on the reserved GPUs just before the job starts: something
        outside campugrid may have taken it since the lease. If so, hand the task back."""
        if not self.lease.gpu_uuids:
            return ()
        mapped, why = sandboxing.gpus_still_free(self.lease,
                                                 gpus.discover(self.gpu_policy).gpus)
        if why:
            self.hand_over(why)
        return mapped

    def run(self) -> None:
        job_id, token, hold = self.lease.job_id, self.lease.fencing_token, self.lease.hold
        self.renewer.start()
        outcome = Outcome(succeeded=False, exit_code=-1)
        failed_here = ""  # the provider failed, not the job: hand back, counting the attempt
        cannot = ""  # this machine cannot run the job: hand back, never to be offered it again
        try:
            outcome = self.execute()
        except CannotRunHere as e:
            cannot = str(e)
            self.shipper.line("build", f"[campugrid] this machine cannot run the job: {cannot}; "
                                       "it goes back to the queue for another machine")
        except (BuildFailed, InvalidInput) as e:  # the job's own fault: final
            outcome = Outcome(succeeded=False, exit_code=-1, reason=str(e))
        except httpx.HTTPError as e:
            failed_here = _http_failure(e)
        except (OSError, SandboxError, grpc.RpcError) as e:
            failed_here = f"{type(e).__name__}: {e}"
        except Exception as e:
            log.exception("task %s crashed the agent's task runner", job_id)
            failed_here = f"agent error: {type(e).__name__}: {e}"
        finally:
            if self.sharing is not None:  # recorded under this lease, logged, before the end
                self.sharing.join()
            self.shipper.close()
        self.stage = Stage.REPORTING
        ending = (Ending.LOST if self.lost.is_set() else Ending.CANNOT_RUN_HERE if cannot
                  else Ending.FAILED_HERE if failed_here else Ending.HANDED_BACK
                  if self.handover else Ending.REPORTED)
        try:
            if ending is Ending.LOST:
                log.info("task %s (%s %d) stopped: %s", job_id, hold.kind, token, self.renewer.reason)
                self.ended = f"stopped: {self.renewer.reason}"
            elif ending is Ending.CANNOT_RUN_HERE:
                log.warning("task %s: this machine cannot run it (%s); handing it back",
                            job_id, cannot)
                retry(lambda: self.client.release(hold, cannot, cannot_run_here=True))
                self.ended = f"handed back: this machine cannot run it: {cannot}"
            elif ending is Ending.FAILED_HERE:
                log.warning("task %s (%s %d) failed on this machine: %s", job_id, hold.kind, token,
                            failed_here)
                retry(lambda: self.client.release(hold, failed_here, failed=True))
                self.ended = f"failed on this machine: {failed_here}"
            elif ending is Ending.HANDED_BACK:
                why = self.handover
                released = retry(lambda: self.client.release(hold, why))
                log.info("task %s (%s %d) handed back: %s", job_id, hold.kind, token,
                         "accepted" if released.accepted else released.reason)
                self.ended = f"handed back: {why}"
            else:
                output = (ENFORCED if self.slot is not None else
                          f"not enforced exactly: checked every {DISK_POLL_S} s")
                final = dataclasses.replace(outcome, limits={**self.sandbox.limits.as_dict(),
                                                             "output": output})
                done = retry(lambda: self.client.complete(hold, final))
                if not done.accepted:
                    log.warning("completion of %s refused: %s", job_id, done.reason)
                self.ended = ("succeeded" if final.succeeded else f"failed: {final.reason}"
                              if done.accepted else f"refused: {done.reason}")
        finally:
            self.stage = Stage.ENDED
            self.renewer.stop()
            # Its image goes with the agent's sweep (worker.JobImages).
            if self.cache is not None:
                self.cache.release(self.user)
            shutil.rmtree(self.work, ignore_errors=True)  # the agent's sweep catches the rest
            if self.files != self.work:
                shutil.rmtree(self.files, ignore_errors=True)

    def prepare(self) -> Outcome | Mapped:
        """PREPARING and BUILDING: download, restore, build and re-check GPUs: the outcome if
        the task ends here, else the GPUs to map."""
        lease, spec, work = self.lease, self.spec, self.work
        context_dir, data_dir = work / "context", work / "data"
        output_dir, ckpt_dir = self.output_dir, self.ckpt_dir
        output_dir.mkdir()
        ckpt_dir.mkdir()
        self.own_dir.mkdir()
        archive = (work / "context.tar").resolve()
        leased = time.monotonic()
        with httpx.Client(timeout=60) as http:
            transfers.download(http, lease.context_url, archive)
            # Untrusted bytes: unpacked, and the Dockerfile parsed, in a confined child.
            size_mb = archive.stat().st_size // 1024**2
            try:
                info = confine.call(extract_context_file, archive, context_dir.resolve(),
                                    allowed_bases(), remote_bases.registries(lease.bases),
                                    writable=[context_dir.resolve()],
                                    limits=confine.Limits(memory_mb=2 * size_mb + 256, cpu_s=120,
                                                          fsize_mb=2048, nofile=256, wall_s=300))
            except confine.ConfinementError as e:  # the job's bytes stopped the unpacker
                raise InvalidInput(f"context: unpacking it was stopped ({e})") from e
            archive.unlink()
            if lease.datasets:
                for note in transfers.fetch_datasets(http, lease, data_dir, self.shares):
                    self.shipper.line("run", f"[campugrid] {note}")
        if lease.resume is not None:
            try:
                checkpoints.restore(lease.resume, ckpt_dir, work)
                self.uploader.done.add(hooks.folder_name(lease.resume.epoch))  # already stored
                self.resumed = lease.resume.epoch
                self.shipper.line("run", f"[campugrid] resuming from the checkpoint of epoch "
                                         f"{lease.resume.epoch}")
            except (InvalidInput, confine.ConfinementError, httpx.HTTPError) as e:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
                ckpt_dir.mkdir()
                why = _http_failure(e) if isinstance(e, httpx.HTTPError) else str(e)
                self.shipper.line("run", f"[campugrid] the checkpoint of epoch {lease.resume.epoch} "
                                         f"is unusable ({why}); starting from scratch")
        build_log = self.shipper.for_stream("build")
        began = time.monotonic()
        try:
            # The pulled bases stay in use (not evicted from the cache) until the task ends.
            local, uses = remote_bases.prepare(info.checked.bases, lease.bases, self.cache,
                                               work, user=self.user, log=build_log,
                                               stop=self.stop)
        except BuildFailed as e:
            return Outcome(succeeded=False, exit_code=-1, reason=e.reason)
        based = time.monotonic()
        build_mb, short = self.build_disk()
        if short:
            raise CannotRunHere(short)
        self.enter(Stage.BUILDING)
        plan = BuildPlan(context_dir, info.checked.froms, local, uses, build_mb, build_log)
        try:
            self.image = images.obtain(self.client, self.cache, images.ImageJob(
                lease=lease, builder=self.builder, bases=uses, tag=self.tag, work=work,
                log=build_log, stop=self.stop, build=functools.partial(self.build_here, plan),
                disk_mb=build_mb, declared=images.declared(spec.build)),
                later=self._share if self.push_beside else None)
        except BuildFailed as e:
            METRICS.build_seconds.labels("failed").observe(time.monotonic() - began)
            return Outcome(succeeded=False, exit_code=-1,
                           reason=f"{e.reason}; last lines of the build log:\n{e.log_tail}")
        done = time.monotonic()
        METRICS.build_seconds.labels("ok").observe(done - began)
        build_log(f"[campugrid] ready to run {done - leased:.1f} s after the lease: context and "
                  f"inputs {began - leased:.1f} s, base images {based - began:.1f} s, image "
                  f"{done - based:.1f} s")
        if self.stop.is_set():
            return Outcome(succeeded=False, exit_code=-1, reason="stopped before running")
        mapped = self._check_gpus()
        if self.handover:
            return Outcome(succeeded=False, exit_code=-1, reason=self.handover)
        return mapped

    def build_here(self, plan: BuildPlan) -> None:
        """Build the image on this machine, in the build's own network, its store on the
        output slot's bounded disk while it builds."""
        spec, lease = self.spec, self.lease
        online = spec.build.network if self.builder.online else "none"
        with self._slot_holds(plan.disk_mb), \
                buildnet.open_network(lease.mirrors, wanted=online, mode=self.build_network,
                                      disk_mb=plan.disk_mb, log=plan.log) as net:
            dockerfile = None
            pins = base_pins(plan.local, self.builder.pins(plan.uses))
            if pins or net.run_args:  # the agent's copy: bases pinned, pip pointed at the
                dockerfile = self.work / "Dockerfile.prepared"  # platform's cache
                dockerfile.write_text(pin_bases((plan.context_dir / "Dockerfile").read_text(),
                                                pins, plan.froms, net.run_args))
            cpus = build_cpus(spec.resources.cpus)
            disk = "on disk" if self.slot is not None else "a tmpfs (memory)"
            plan.log(f"[campugrid] building with {self.builder.name} on {cpus:g} CPUs and "
                     f"{plan.disk_mb} MB of disk ({disk}), RUN steps under gVisor; network: "
                     f"{net.why}")
            self.builder.build(plan.context_dir, self.tag, log=plan.log,
                               timeout_s=min(BUILD_TIMEOUT_S, spec.resources.wall_time_s),
                               cancel=self.stop, memory_mb=spec.resources.memory_mb,
                               cpus=cpus, disk_mb=plan.disk_mb,
                               bases=plan.uses, dockerfile=dockerfile, volumes=net.volumes,
                               egress=net.socket,
                               store_on=self.files if self.slot is not None else None)

    def build_disk(self) -> tuple[int, str]:
        """The build's disk in MB, and why this machine cannot give it ('' if it can): what
        the job asks (resources.build_mb), else what the output slot holds up to BUILD_MB;
        without a slot, a tmpfs, which is memory: what the job asks, else its disk_mb."""
        asked = self.spec.resources.build_mb
        if self.slot is None:
            return asked or self.spec.resources.disk_mb, ""
        offered = (self.slot.capacity() + self.slot.used()) // 1024**2
        if asked is not None and asked > offered:
            return asked, (f"this machine's build disk holds {offered} MB; the job asks for "
                           f"{asked} MB (resources.build_mb)")
        return asked or min(BUILD_MB, offered), ""

    @contextlib.contextmanager
    def _slot_holds(self, build_mb: int) -> Iterator[None]:
        """While the build runs, the output slot holds its disk (the store is in the task's
        folder); then /output and /checkpoints to output_mb again."""
        if self.slot is None:
            yield
            return
        self.slot.resize(build_mb * 1024**2)
        try:
            yield
        finally:
            self.slot.resize(self.spec.resources.output_mb * 1024**2)

    def _share(self, push: Callable[[], object]) -> None:
        """The push of this task's build runs beside the job: others wait for it, this job
        need not (run() waits for it before it reports)."""
        self.sharing = logs.thread(push, name=f"share-{self.lease.job_id}")
        self.sharing.start()

    def execute(self) -> Outcome:
        """Everything up to the report: `prepare`, then RUNNING (the job in the sandbox) and
        the first part of REPORTING (the last checkpoints, /output)."""
        lease, spec, work = self.lease, self.spec, self.work
        output_dir, ckpt_dir = self.output_dir, self.ckpt_dir
        mapped = self.prepare()
        if isinstance(mapped, Outcome):
            return mapped
        self.enter(Stage.RUNNING)
        self.renewer.renew_now()
        last_line: list[str] = []
        run_log = self.shipper.for_stream("run")

        def on_line(text: str) -> None:
            if text.strip():
                last_line[:] = [text]
            run_log(text)

        env = self.job_env()
        self.uploader.start()
        watch = logs.thread(self._watch_disk, (output_dir, ckpt_dir, self.own_dir),
                            name=f"disk-{lease.job_id}")
        watch.start()
        try:
            result = self.sandbox.run(self.run_request(spec.command, env, mapped), log=on_line,
                                      cancel=self.stop)
        except BaseException:  # e.g. SandboxError: nothing ran, no last checkpoint to take
            self.uploader.stop(wait=False)
            raise
        finally:
            self.ran.set()
        self.stage = Stage.REPORTING
        if result.started_s is not None:
            METRICS.sandbox_start_seconds.labels("run").observe(result.started_s)
        if not self.lost.is_set():
            try:
                self.uploader.flush()  # the final checkpoint of a drained job, too
            except (grpc.RpcError, httpx.HTTPError, OSError, CampugridError) as e:
                why = _http_failure(e) if isinstance(e, httpx.HTTPError) else str(e)
                self.shipper.line("run", f"[campugrid] the last checkpoint was not kept: {why}")
        else:
            self.uploader.stop(wait=False)  # the coordinator would refuse what it uploads
        listed: tuple[tuple[str, int], ...] = ()
        if not self.stop.is_set() and not self.handover and not self.disk_exceeded:
            listed = transfers.upload_output(lease.output_url, output_dir,
                                             work / "output.tar.gz")
        if self.disk_exceeded:
            reason = (f"the job wrote more than {spec.resources.output_mb} MB to /output and "
                      "/checkpoints (resources.output_mb); it was stopped")
        elif result.timed_out:
            reason = f"wall time of {spec.resources.wall_time_s} s exceeded; the job was stopped"
        elif result.oom_killed:
            reason = f"out of memory: the job used more than {spec.resources.memory_mb} MB"
        elif result.exit_code == 128 + signal.SIGXFSZ:
            reason = (f"a file the job wrote reached {spec.resources.output_mb} MB "
                      "(resources.output_mb, the limit for any one file); the job was stopped")
        elif result.exit_code != 0:
            reason = f"the job's command exited with status {result.exit_code}"
        else:
            reason = ""
        return Outcome(
            succeeded=result.exit_code == 0 and not result.timed_out and not self.disk_exceeded,
            exit_code=result.exit_code,
            reason=reason, result=last_line[0][-4000:] if last_line else "",
            output_uploaded=bool(listed),
            output_files=tuple((p[:256], n) for p, n in listed[:200]))  # as it is kept

    def job_env(self) -> dict[str, str]:
        return sandboxing.job_env(self.spec, self.lease,
                                  lambda: self.ops().image_env(self.image), self.resumed)

    def ops(self) -> PodmanOps:
        """This agent's container engine, as its runtime offers it."""
        return self.sandbox.ops

    def run_request(self, command: tuple[str, ...] | None, env: dict[str, str],
                    mapped: Mapped, *, writable: bool = True) -> RunRequest:
        """This task's sandbox; with `writable`, its /output and checkpoint folders."""
        return sandboxing.run_request(
            name=self.name, image=self.image, spec=self.spec, lease=self.lease,
            agent=self.client.machine_id, files=self.files if writable else None,
            data_dir=self.work / "data", command=command, env=env, mapped=mapped)


def base_pins(pulled: dict[BaseUse, str], named: dict[BaseUse, str]) -> dict[BaseUse, str]:
    """What each checked FROM (or COPY --from) becomes in the Dockerfile the builder gets: a
    pulled base's local name (`pulled`, keyed by the checked use), unless the builder names
    the base otherwise (`named`, keyed by the use as the builder was given it: Kaniko pins
    every base to its digest); keyed by the checked use, whose lines pin_bases replaces."""
    pins = dict(pulled)
    checked = {(use.line, use.copy): use for use in pulled}
    for use, name in named.items():
        pins[checked.get((use.line, use.copy), use)] = name
    return pins


def job_image_prefix(scope: str) -> str:
    """Where this agent's job images are named: what its sweeps may remove."""
    return f"localhost/campugrid-job/{scope or 'agent'}/"


def _http_failure(e: httpx.HTTPError) -> str:
    """What went wrong, without the URL: presigned URLs are credentials."""
    what = "a transfer to or from object storage"
    if isinstance(e, httpx.HTTPStatusError):
        return f"{what} failed: HTTP {e.response.status_code}"
    return f"{what} failed: {type(e).__name__}"


def retry(call: Callable[[], R]) -> R:
    """A report survives a coordinator restart of a few seconds (the lease covers longer)."""
    for delay in (1, 2, 4, 8):
        try:
            return call()
        except grpc.RpcError as e:
            log.warning("report failed (%s); retrying in %d s", e.code(), delay)
            time.sleep(delay)
    return call()
