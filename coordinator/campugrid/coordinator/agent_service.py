"""The agents' gRPC service. Agents dial out to it; it never calls them.

A refusal that an agent is expected to act on (its attempt is stale, the job was cancelled)
is an ordinary answer (keep_going=false, accepted=false), not an error; errors are for
callers that are broken or unauthenticated.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from limits import RateLimitItemPerMinute

from campugrid.coordinator.agent_calls import CALLER, Abort, Aborts, peer_address
from campugrid.coordinator.answers import answer
from campugrid.coordinator.fleet import Fleet, Link
from campugrid.coordinator.gpu_history import GpuMemory
from campugrid.coordinator.machines import Status, reported, said_digest
from campugrid.coordinator.scheduler import GpuView, MachineView
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.services.supplies import Supplies
from campugrid.coordinator.views import HoldKind, HoldRef, ShardResult, ShardTask
from campugrid.coordinator.views import Lease as Granted  # the class has a method Lease
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol.errors import (
    CampugridError,
    IllegalTransition,
    InvalidInput,
    StaleAttempt,
)
from campugrid.protocol.states import JobState
from campugrid.protocol.wire import KEY_HEADER, STREAM_TAKEN

log = logging.getLogger("campugrid.coordinator.agents")

R = TypeVar("R")


MAX_SHARES, MAX_SHARED_FILES = 16, 1000
MAX_GPU_MB = 2 * 1024**2  # 2 TiB: more than any GPU's memory, or a Mac's
MAX_HELD = 300  # why an owner holds the machine: shown to researchers, so short and printable


def _caps(c: pb.Capabilities) -> dict[str, Any]:
    return {"runtime": c.runtime, "builder": c.builder, "cpus": _size(c.cpus),
            "memory_mb": _size(c.memory_mb), "disk_mb": _size(c.disk_mb),
            "limits": dict(c.limits),
            "gpu_isolation": c.gpu_isolation, "gpu_note": c.gpu_note,
            "speed_gflops": c.speed_gflops if math.isfinite(c.speed_gflops) else 0.0,
            "held": "".join(ch if ch.isprintable() else " " for ch in c.held[:MAX_HELD]),
            # What a provider says it shares is only a listing: the agent checks every file
            # by sha256 when a job uses it. Bounded, as everything an agent reports.
            "shares": {sh.name[:64]: [[f.path[:1000], max(0, f.size), f.sha256[:64]]
                                      for f in sh.files[:MAX_SHARED_FILES]]
                       for sh in c.shares[:MAX_SHARES]}}


def _size(reported: int) -> int:
    """A size an agent reports, bounded (2**30 MB is a petabyte; as many CPUs, more than any)."""
    return min(max(0, int(reported)), 2**30)


def _gpus(gpus: Sequence[pb.Gpu]) -> tuple[GpuView, ...]:
    out = []
    for g in gpus:
        cc = (0, 0)
        if g.compute_capability.count(".") == 1:
            major, minor = g.compute_capability.split(".")
            if major.isdigit() and minor.isdigit():
                cc = (int(major), int(minor))
        out.append(GpuView(g.uuid[:100], g.kind or "nvidia", g.name[:200],
                           max(0, int(g.memory_free_mb)), 0, cc))
    return tuple(out)


def _offered(machine: str, c: pb.Capabilities) -> MachineView:
    """The GPUs a heartbeat's capabilities say the machine has."""
    return MachineView(machine, "", _gpus(c.gpus), c.gpu_isolation)


def _said(machine: str, beat: pb.HeartbeatRequest) -> str:
    """What this heartbeat would store (machines.said_digest); "" if it says nothing."""
    if not beat.HasField("capabilities"):
        return ""
    return said_digest(*reported(_caps(beat.capabilities), _offered(machine, beat.capabilities)))


def _memory(gpus: Sequence[pb.Gpu]) -> list[GpuMemory]:
    """What an agent says of its GPUs' memory, bounded (it draws every machine's chart to
    one scale: a made-up size must not flatten the others')."""
    out = []
    for g in gpus:
        total = min(max(0, int(g.memory_total_mb)), MAX_GPU_MB)
        out.append(GpuMemory(g.uuid[:100], g.name[:200], g.shared_memory or g.kind == "apple",
                             total, min(max(0, int(g.memory_free_mb)), total)))
    return out


class AgentService(pb_grpc.AgentServiceServicer):
    """Plain functions run on the server's pool of threads; Connect is a coroutine on the
    server's loop, whose checks run on `blocking`, as do the dispatcher's claims (fleet.py)."""

    def __init__(self, coord: Coordinator, supplies: Supplies,
                 register_per_minute: int = 20, blocking: Executor | None = None) -> None:
        self.coord = coord
        self.blocking = blocking or ThreadPoolExecutor(16, thread_name_prefix="grpc-streams")
        # The machines connected on a stream; its dispatcher runs on the server's loop.
        self.fleet = Fleet(coord.leasing, coord.machines, coord.work, self.blocking, self.reply,
                           on_leased=lambda lease, took: self.metrics.leased(
                               took, _first_queued(lease), True))
        coord.machines.revoked.append(lambda machine: self.fleet.close(
            machine, "this machine was revoked by its owner"))
        self.supplies = supplies  # the caches, the egress proxy and the bases' sources
        self.metrics = coord.metrics
        self._limiter = coord.limiter  # shared by every coordinator process
        self._register_limit = RateLimitItemPerMinute(register_per_minute)

    @staticmethod
    def _machine(context: grpc.ServicerContext, *, pending_ok: bool = False) -> str:
        """The calling machine (its signature was checked by SignedCalls); only an approved
        one gets past here, but for the calls a pending machine may make."""
        record = CALLER.get()
        if record is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call was not signed")
        assert record is not None
        if record.status is Status.PENDING and not pending_ok:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, (
                f"machine {record.id} is pending: its owner must compare its fingerprint "
                f"{record.fingerprint} and run `campugrid machines approve {record.id}`"))
        if record.status is Status.QUARANTINED and not pending_ok:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, (
                f"machine {record.id} is quarantined: {record.quarantine} An admin reinstates "
                f"it with `campugrid machines approve {record.id}` or revokes it"))
        return record.id

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except StaleAttempt:  # answered, not aborted: see the module docstring
            self.metrics.refused("grpc", "stale")
            raise
        except IllegalTransition:
            self.metrics.refused("grpc", "illegal_transition")
            raise
        except CampugridError as e:
            context.abort(answer(e).grpc, str(e))
        raise AssertionError("unreachable")

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        """A machine for the key that signed this call (SignedCalls checked it): pending until
        its owner approves it. Rate-limited per address."""
        address = peer_address(context)
        if not self._limiter.hit(self._register_limit, "register", address):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "too many registrations from this address; wait a minute")
        key = str(dict(context.invocation_metadata()).get(KEY_HEADER, ""))
        record = self._guard(context, lambda: self.coord.machines.register(
            request.name, key, address))
        if request.HasField("capabilities"):
            self.coord.machines.heartbeat(record.id, _caps(request.capabilities), None)
        return pb.RegisterReply(machine_id=record.id, status=record.status.value,
                                fingerprint=record.fingerprint)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        self._heard(self._machine(context, pending_ok=True), request)
        return pb.HeartbeatReply()

    def _heard(self, machine: str, request: pb.HeartbeatRequest) -> None:
        """A heartbeat (a call, or a message on the machine's stream): it is alive, with
        what it has now."""
        if request.HasField("capabilities"):
            c = request.capabilities
            self.coord.machines.heartbeat(machine, _caps(c), _offered(machine, c))
            record = CALLER.get()
            if record is not None and record.status is Status.APPROVED:  # not a stranger's
                self.coord.machines.note_memory(machine, _memory(c.gpus))
        else:
            self.coord.machines.heartbeat(machine, None, None)

    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseReply:
        """One claim for the calling machine, answered at once: a task, or none. (An idle agent
        does not ask again and again: it waits on its stream, Connect, and the dispatcher
        claims for it when work comes.)"""
        machine = self._machine(context)
        offer = self._offer(machine, request)
        lease, took = self._guard(context, lambda: self.coord.leasing.timed_lease(machine, offer))
        if lease is None:
            self.metrics.leased(took, None, False)
            return pb.LeaseReply(has_task=False)
        # A first attempt's wait in the queue ends now (a later attempt's began at a requeue,
        # which the lease does not see).
        self.metrics.leased(took, _first_queued(lease), True)
        return self.reply(lease, machine, request.hold_kinds)

    def _offer(self, machine: str, request: pb.LeaseRequest) -> MachineView:
        """What the machine says a task can be given there, bounded; its GPUs' memory noted
        for the console's chart."""
        self.coord.machines.note_memory(machine, _memory(request.gpus))
        return MachineView(machine, "", _gpus(request.gpus), request.gpu_isolation,
                           enforced=frozenset(request.enforced_limits),
                           shares=frozenset(x[:64] for x in request.shares[:MAX_SHARES]),
                           cpus=_size(request.cpus), memory_mb=_size(request.memory_mb),
                           disk_mb=_size(request.disk_mb))

    def reply(self, lease: Granted, machine: str, hold_kinds: bool) -> pb.LeaseReply:
        """A lease as the agent receives it (from Lease, or down its stream)."""
        job, hold = lease.job, lease.hold
        return pb.LeaseReply(
            has_task=True, job_id=job.id, attempt=job.attempt,
            fencing_token=_token_for(hold, hold_kinds), hold_kind=_KIND_PB[hold.kind],
            lease_seconds=lease.lease_seconds, spec_json=job.spec_json,
            context_url=lease.context_url, output_url=lease.output_url,
            datasets=[pb.Dataset(name=name, share=lease.shares.get(name, ""),
                                 files=[pb.Dataset.File(path=f.path, url=f.url, size=f.size,
                                                        sha256=f.sha256) for f in files])
                      for name, files in lease.datasets.items()],
            resume=(pb.Resume(epoch=lease.resume.epoch, url=lease.resume_url,
                              size=lease.resume.size, sha256=lease.resume.sha256)
                    if lease.resume is not None else None),
            gpu_uuids=lease.gpu_uuids, gpu_memory_mb=job.spec.resources.gpu_memory_mb,
            shard=_shard_pb(lease.shard),
            bases=[pb.BaseImage(ref=b.ref, digest=b.digest, sources=[
                pb.BaseImage.Source(address=x.address, insecure=x.insecure, token=x.token)
                for x in b.sources]) for b in self.supplies.bases(job.bases, machine)],
            mirrors=[pb.Mirror(kind=m.kind, url=m.url, token=m.token, certificate=m.certificate)
                     for m in self.supplies.mirrors(machine)],
        )

    async def Connect(self, requests: AsyncIterator[pb.AgentEvent],
                      context: Any) -> AsyncIterator[pb.CoordinatorEvent]:
        """An idle machine's stream (fleet.py): its readiness and heartbeats in, its leases
        out. Every message is the machine's that signed the call (SignedCalls)."""
        try:
            machine = self._machine(Aborts(context))
        except Abort as a:
            await context.abort(a.code, a.details)
            return
        await context.send_initial_metadata((STREAM_TAKEN,))
        link = self.fleet.connect(machine)
        record = CALLER.get()
        link.heard = record.said if record is not None else ""
        reading = asyncio.create_task(self._hear(requests, link, context))
        try:
            while (event := await link.outbox.get()) is not None:
                yield event
        finally:
            reading.cancel()
            self.fleet.disconnect(link)

    async def _hear(self, requests: AsyncIterator[pb.AgentEvent], link: Link,
                    context: Any) -> None:
        """What a machine says on its stream; its end ends the stream."""
        loop = asyncio.get_running_loop()
        call = contextvars.copy_context()  # the checked machine (CALLER), for the threads
        try:
            async for event in requests:
                if event.HasField("ready"):
                    offer = await loop.run_in_executor(self.blocking, call.run, self._offer,
                                                       link.machine_id, event.ready)
                    self.fleet.ready(link, offer, event.ready.hold_kinds)
                elif event.HasField("heartbeat"):
                    beat = event.heartbeat
                    if beat.capabilities.held:
                        link.offer = None  # its owner holds it: ready again when it says so
                    # Only what differs from what is stored is written (a machine reconnecting
                    # after a restart usually says the same again); that it is alive, the
                    # fleet writes for every connected machine at once (`seen`).
                    said = _said(link.machine_id, beat)
                    if said and said != link.heard:
                        link.heard = said
                        await loop.run_in_executor(self.blocking, call.run, self._heard,
                                                   link.machine_id, beat)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken stream: the agent connects again
            log.info("stream of machine %s ended: %s", link.machine_id, type(e).__name__)
        self.fleet.end(link, "the machine's side of the stream ended")

    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        machine = self._machine(context)
        phase = JobState.RUNNING if request.phase == "running" else JobState.BUILDING
        try:
            lease_s = self._guard(context, lambda: self.coord.leasing.renew(
                _hold(request, machine), phase))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.RenewReply(keep_going=False, reason=str(e))
        return pb.RenewReply(keep_going=True, lease_seconds=lease_s)

    def ReportLogs(self, request: pb.LogsRequest, context: grpc.ServicerContext) -> pb.LogsReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.leasing.report_logs(
                _hold(request, machine), request.stream, request.seq, request.text))
        except (StaleAttempt, IllegalTransition):
            return pb.LogsReply(accepted=False)
        return pb.LogsReply(accepted=True)

    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> pb.CompleteReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.leasing.complete(
                _hold(request, machine), succeeded=request.succeeded,
                exit_code=request.exit_code, reason=request.reason or None,
                result=request.result or None, output_uploaded=request.output_uploaded,
                limits=dict(request.limits),
                output_files=[(f.path[:1000], f.size) for f in request.output_files[:1000]]))
        except (StaleAttempt, IllegalTransition) as e:
            log.warning("completion refused: %s", e)
            return pb.CompleteReply(accepted=False, reason=str(e))
        return pb.CompleteReply(accepted=True)

    def BeginCheckpoint(self, request: pb.BeginCheckpointRequest,
                        context: grpc.ServicerContext) -> pb.BeginCheckpointReply:
        machine = self._machine(context)
        try:
            up = self._guard(context, lambda: self.coord.leasing.begin_checkpoint(
                _hold(request, machine), request.epoch, request.size))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.BeginCheckpointReply(accepted=False, reason=str(e))
        return pb.BeginCheckpointReply(accepted=True, key=up.key, upload_id=up.upload_id,
                                       part_size=up.part_size, part_urls=up.part_urls)

    def RecordCheckpoint(self, request: pb.RecordCheckpointRequest,
                         context: grpc.ServicerContext) -> pb.RecordCheckpointReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.leasing.record_checkpoint(
                _hold(request, machine), epoch=request.epoch,
                key=request.key, upload_id=request.upload_id, etags=list(request.etags),
                size=request.size, sha256=request.sha256, label=request.label))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.RecordCheckpointReply(accepted=False, reason=str(e))
        self.metrics.checkpoint_recorded(request.size)
        return pb.RecordCheckpointReply(accepted=True)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.leasing.release(
                _hold(request, machine), request.reason,
                failed=request.failed, cannot_run_here=request.cannot_run_here))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.ReleaseReply(accepted=False, reason=str(e))
        log.info("job %s handed back by machine %s: %s", request.job_id, machine,
                 "it cannot run it" if request.cannot_run_here else
                 "failed there" if request.failed else "drained")
        return pb.ReleaseReply(accepted=True)

    def NextShard(self, request: pb.NextShardRequest,
                  context: grpc.ServicerContext) -> pb.NextShardReply:
        machine = self._machine(context)
        done = None
        if request.HasField("done"):
            d = request.done
            done = ShardResult(d.index, d.succeeded, d.exit_code, d.result_json or None,
                               d.reason[:4000] or None)
        try:
            task = self._guard(context, lambda: self.coord.leasing.next_shard(
                _hold(request, machine), done))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.NextShardReply(accepted=False, reason=str(e))
        if task is None:
            return pb.NextShardReply(accepted=True, has_shard=False)
        return pb.NextShardReply(accepted=True, has_shard=True, shard=_shard_pb(task))


    def Image(self, request: pb.ImageRequest, context: grpc.ServicerContext) -> pb.ImageReply:
        machine = self._machine(context)
        try:
            a = self._guard(context, lambda: self.coord.images.step(
                _hold(request, machine), request.step, request.inputs_json, request.digest))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.ImageReply(accepted=False, reason=str(e))
        return pb.ImageReply(accepted=True, action=a.action, registry=a.registry,
                             repository=a.repository, digest=a.digest, token=a.token,
                             push=a.push, retry_seconds=a.retry_s, built_by=a.built_by)


_KIND_PB = {HoldKind.ATTEMPT: pb.ATTEMPT, HoldKind.SESSION: pb.SESSION}
_KIND = {v: k for k, v in _KIND_PB.items()}


# Agents from before hold kinds tell a session from an attempt by the token alone: a session's
# token was offset by this. They are given tokens the old way (LeaseRequest.hold_kinds unset)
# and their calls, which carry no kind (ATTEMPT, the default), read that way; an attempt's
# number never comes near it. Remove once no such agent is left.
LEGACY_SESSION_BASE = 1 << 40


def _first_queued(lease: Granted) -> dt.datetime | None:
    """When the job was submitted, if this is its first attempt (for the queue wait; a later
    attempt's wait began at a requeue, which the lease does not see)."""
    job = lease.job
    return job.created_at if job.attempt == 1 and lease.shard is None else None


def _token_for(hold: HoldRef, names_kinds: bool) -> int:
    if hold.kind is HoldKind.SESSION and not names_kinds:
        return LEGACY_SESSION_BASE + hold.token
    return hold.token


def _hold(request: Any, machine: str) -> HoldRef:
    """The hold a call about held work names (its kind as the message says), as `machine`
    claims it; holds.py checks that it holds it."""
    kind = _KIND.get(request.hold_kind)
    if kind is None:
        raise InvalidInput(f"hold_kind: unknown ({request.hold_kind}); update the agent")
    token = request.fencing_token
    if kind is HoldKind.ATTEMPT and token >= LEGACY_SESSION_BASE:  # an agent from before
        kind, token = HoldKind.SESSION, token - LEGACY_SESSION_BASE
    return HoldRef(request.job_id, kind, token, machine)


def _shard_pb(task: ShardTask | None) -> pb.ShardTask | None:
    if task is None:
        return None
    return pb.ShardTask(index=task.index, payload_json=task.payload_json, cost=task.cost)
