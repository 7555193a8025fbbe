"""The agents' gRPC service. Agents dial out to it; it never calls them.

A refusal that an agent is expected to act on (its attempt is stale, the job was cancelled)
is an ordinary answer (keep_going=false, accepted=false), not an error; errors are for
callers that are broken or unauthenticated.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from campugrid.coordinator.scheduler import GpuView, MachineView
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.views import ShardResult, ShardTask
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import logs
from campugrid.protocol.errors import (
    CampugridError,
    IllegalTransition,
    InvalidInput,
    NotFound,
    StaleAttempt,
    Unauthenticated,
)
from campugrid.protocol.states import JobState
from campugrid.protocol.wire import MACHINE_HEADER, SECRET_HEADER

log = logging.getLogger("campugrid.coordinator.agents")
AUTH_CACHE_S = 30.0  # a checked secret is trusted this long without a database read

R = TypeVar("R")


def _caps(c: pb.Capabilities) -> dict[str, Any]:
    return {"runtime": c.runtime, "builder": c.builder, "cpus": c.cpus,
            "memory_mb": c.memory_mb, "limits": dict(c.limits),
            "gpu_isolation": c.gpu_isolation, "gpu_note": c.gpu_note,
            "speed_gflops": c.speed_gflops if math.isfinite(c.speed_gflops) else 0.0}


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


class AgentService(pb_grpc.AgentServiceServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        # (machine, sha256 of the secret it showed) -> when to check with the store again
        self._known: dict[tuple[str, str], float] = {}
        self._known_lock = threading.Lock()

    def _machine(self, context: grpc.ServicerContext) -> str:
        md = dict(context.invocation_metadata())
        machine_id, secret = str(md.get(MACHINE_HEADER, "")), str(md.get(SECRET_HEADER, ""))
        key = (machine_id, hashlib.sha256(secret.encode()).hexdigest())
        now = time.monotonic()
        with self._known_lock:
            if self._known.get(key, 0.0) > now:
                return machine_id
        try:
            self.coord.authenticate_machine(machine_id, secret)
        except Unauthenticated as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        with self._known_lock:
            if len(self._known) > 100_000:
                self._known.clear()
            self._known[key] = now + AUTH_CACHE_S
        return machine_id

    @staticmethod
    def _guard(context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except (StaleAttempt, IllegalTransition):
            raise  # answered, not aborted: see the module docstring
        except NotFound as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except InvalidInput as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CampugridError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("unreachable")

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        machine_id, secret = self._guard(context, lambda: self.coord.register_machine(
            request.name, _caps(request.capabilities)))
        log.info("machine registered: %s (%s)", machine_id, request.name)
        return pb.RegisterReply(machine_id=machine_id, secret=secret)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        machine = self._machine(context)
        if request.HasField("capabilities"):
            c = request.capabilities
            self.coord.heartbeat(machine, _caps(c),
                                 MachineView(machine, "", _gpus(c.gpus), c.gpu_isolation))
        else:
            self.coord.heartbeat(machine, None, None)
        return pb.HeartbeatReply()

    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseReply:
        machine = self._machine(context)
        offer = MachineView(machine, "", _gpus(request.gpus), request.gpu_isolation,
                            enforced=frozenset(request.enforced_limits))
        lease = self._guard(context, lambda: self.coord.lease(machine, offer))
        if lease is None:
            return pb.LeaseReply(has_task=False)
        job = lease.job
        return pb.LeaseReply(
            has_task=True, job_id=job.id, attempt=job.attempt, fencing_token=lease.token,
            lease_seconds=lease.lease_seconds, spec_json=job.spec_json,
            context_url=lease.context_url, output_url=lease.output_url,
            datasets=[pb.Dataset(name=name, files=[pb.Dataset.File(path=f.path, url=f.url, size=f.size)
                                                    for f in files])
                      for name, files in lease.datasets.items()],
            resume=(pb.Resume(epoch=lease.resume.epoch, url=lease.resume_url,
                              size=lease.resume.size, sha256=lease.resume.sha256)
                    if lease.resume is not None else None),
            gpu_uuids=lease.gpu_uuids, gpu_memory_mb=job.spec.resources.gpu_memory_mb,
            shard=_shard_pb(lease.shard),
        )

    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        machine = self._machine(context)
        phase = JobState.RUNNING if request.phase == "running" else JobState.BUILDING
        try:
            lease_s = self._guard(context, lambda: self.coord.renew(
                request.job_id, request.fencing_token, machine, phase))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.RenewReply(keep_going=False, reason=str(e))
        return pb.RenewReply(keep_going=True, lease_seconds=lease_s)

    def ReportLogs(self, request: pb.LogsRequest, context: grpc.ServicerContext) -> pb.LogsReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.report_logs(
                request.job_id, request.fencing_token, machine, request.stream, request.seq,
                request.text))
        except (StaleAttempt, IllegalTransition):
            return pb.LogsReply(accepted=False)
        return pb.LogsReply(accepted=True)

    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> pb.CompleteReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.complete(
                request.job_id, request.fencing_token, machine, succeeded=request.succeeded,
                exit_code=request.exit_code, reason=request.reason or None,
                result=request.result or None, output_uploaded=request.output_uploaded,
                limits=dict(request.limits)))
        except (StaleAttempt, IllegalTransition) as e:
            log.warning("completion refused: %s", e)
            return pb.CompleteReply(accepted=False, reason=str(e))
        return pb.CompleteReply(accepted=True)

    def BeginCheckpoint(self, request: pb.BeginCheckpointRequest,
                        context: grpc.ServicerContext) -> pb.BeginCheckpointReply:
        machine = self._machine(context)
        try:
            up = self._guard(context, lambda: self.coord.begin_checkpoint(
                request.job_id, request.fencing_token, machine, request.epoch, request.size))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.BeginCheckpointReply(accepted=False, reason=str(e))
        return pb.BeginCheckpointReply(accepted=True, key=up.key, upload_id=up.upload_id,
                                       part_size=up.part_size, part_urls=up.part_urls)

    def RecordCheckpoint(self, request: pb.RecordCheckpointRequest,
                         context: grpc.ServicerContext) -> pb.RecordCheckpointReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.record_checkpoint(
                request.job_id, request.fencing_token, machine, epoch=request.epoch,
                key=request.key, upload_id=request.upload_id, etags=list(request.etags),
                size=request.size, sha256=request.sha256))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.RecordCheckpointReply(accepted=False, reason=str(e))
        return pb.RecordCheckpointReply(accepted=True)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        machine = self._machine(context)
        try:
            self._guard(context, lambda: self.coord.release(
                request.job_id, request.fencing_token, machine, request.reason,
                failed=request.failed))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.ReleaseReply(accepted=False, reason=str(e))
        log.info("job %s released after a drain", request.job_id)
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
            task = self._guard(context, lambda: self.coord.next_shard(
                request.job_id, request.fencing_token, machine, done))
        except (StaleAttempt, IllegalTransition) as e:
            return pb.NextShardReply(accepted=False, reason=str(e))
        if task is None:
            return pb.NextShardReply(accepted=True, has_shard=False)
        return pb.NextShardReply(accepted=True, has_shard=True, shard=_shard_pb(task))


def _shard_pb(task: ShardTask | None) -> pb.ShardTask | None:
    if task is None:
        return None
    return pb.ShardTask(index=task.index, payload_json=task.payload_json, cost=task.cost)


class AboutJob(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Every line logged while serving a call about a job names the job and the attempt
    (campugrid.protocol.logs), without each handler saying so."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            job_id = getattr(request, "job_id", "")
            if not job_id:
                return inner(request, context)
            with logs.about_job(job_id, getattr(request, "fencing_token", None) or None):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
