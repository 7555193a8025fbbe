"""The agent's side of the gRPC protocol, and its stored machine credentials.

Two layers: CoordinatorClient is the wire (protobuf in and out, as the coordinator's service
tests use it); CoordinatorApi is what the agent's code talks to, in frozen values
(campugrid.agent.messages), converted here and nowhere else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from campugrid.agent import messages as m
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol.wire import MACHINE_HEADER, SECRET_HEADER

RPC_TIMEOUT_S = 10.0


class CoordinatorClient:
    """The gRPC stub with this machine's credentials: protobuf in and out."""

    def __init__(self, address: str, credentials_file: Path) -> None:
        self.address = address
        self.credentials_file = credentials_file
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ])
        self.stub = pb_grpc.AgentServiceStub(self.channel)
        self.machine_id = ""
        self._secret = ""

    def ensure_registered(self, name: str, caps: pb.Capabilities) -> str:
        """Reuse stored credentials when the coordinator still knows them, else register."""
        try:
            stored = json.loads(self.credentials_file.read_text())
        except (OSError, ValueError):
            stored = None  # none yet, or damaged: register afresh
        usable = (isinstance(stored, dict) and {"machine_id", "secret"} <= stored.keys()
                  and stored.get("coordinator") == self.address)
        if usable:
            self.machine_id, self._secret = str(stored["machine_id"]), str(stored["secret"])
            try:
                self.heartbeat(caps)
                return self.machine_id
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                    raise
        reply = self.stub.Register(pb.RegisterRequest(name=name, capabilities=caps),
                                   timeout=RPC_TIMEOUT_S)
        self.machine_id, self._secret = reply.machine_id, reply.secret
        self.credentials_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.credentials_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"coordinator": self.address, "machine_id": reply.machine_id,
                       "secret": reply.secret}, f)
        os.replace(tmp, self.credentials_file)
        return self.machine_id

    @property
    def _md(self) -> tuple[tuple[str, str], ...]:
        return ((MACHINE_HEADER, self.machine_id), (SECRET_HEADER, self._secret))

    def heartbeat(self, caps: pb.Capabilities | None = None) -> None:
        req = pb.HeartbeatRequest(capabilities=caps) if caps is not None else pb.HeartbeatRequest()
        self.stub.Heartbeat(req, metadata=self._md, timeout=RPC_TIMEOUT_S)

    def lease(self, gpus: Sequence[pb.Gpu] = (), gpu_isolation: bool = False,
              enforced: Sequence[str] = ()) -> pb.LeaseReply:
        reply: pb.LeaseReply = self.stub.Lease(
            pb.LeaseRequest(gpus=gpus, gpu_isolation=gpu_isolation, enforced_limits=enforced),
            metadata=self._md, timeout=RPC_TIMEOUT_S)
        return reply

    def renew(self, job_id: str, token: int, phase: str, timeout_s: float) -> pb.RenewReply:
        reply: pb.RenewReply = self.stub.Renew(
            pb.RenewRequest(job_id=job_id, fencing_token=token, phase=phase),
            metadata=self._md, timeout=timeout_s)
        return reply

    def logs(self, job_id: str, token: int, stream: str, seq: int, text: str) -> bool:
        reply = self.stub.ReportLogs(
            pb.LogsRequest(job_id=job_id, fencing_token=token, stream=stream, seq=seq, text=text),
            metadata=self._md, timeout=RPC_TIMEOUT_S)
        return bool(reply.accepted)

    def complete(self, req: pb.CompleteRequest) -> pb.CompleteReply:
        reply: pb.CompleteReply = self.stub.Complete(req, metadata=self._md, timeout=RPC_TIMEOUT_S)
        return reply

    def begin_checkpoint(self, job_id: str, token: int, epoch: int,
                         size: int) -> pb.BeginCheckpointReply:
        reply: pb.BeginCheckpointReply = self.stub.BeginCheckpoint(
            pb.BeginCheckpointRequest(job_id=job_id, fencing_token=token, epoch=epoch, size=size),
            metadata=self._md, timeout=RPC_TIMEOUT_S)
        return reply

    def record_checkpoint(self, req: pb.RecordCheckpointRequest) -> pb.RecordCheckpointReply:
        # Generous: the coordinator reads the object back to check its digest.
        reply: pb.RecordCheckpointReply = self.stub.RecordCheckpoint(req, metadata=self._md,
                                                                     timeout=300)
        return reply

    def release(self, job_id: str, token: int, reason: str, failed: bool = False) -> pb.ReleaseReply:
        reply: pb.ReleaseReply = self.stub.Release(
            pb.ReleaseRequest(job_id=job_id, fencing_token=token, reason=reason, failed=failed),
            metadata=self._md, timeout=RPC_TIMEOUT_S)
        return reply

    def next_shard(self, job_id: str, token: int,
                   done: pb.ShardResult | None) -> pb.NextShardReply:
        reply: pb.NextShardReply = self.stub.NextShard(
            pb.NextShardRequest(job_id=job_id, fencing_token=token, done=done),
            metadata=self._md, timeout=RPC_TIMEOUT_S)
        return reply

    def close(self) -> None:
        self.channel.close()


class CoordinatorApi:
    """The coordinator, as the agent's code sees it: frozen values in and out."""

    def __init__(self, wire: CoordinatorClient) -> None:
        self.wire = wire

    @property
    def machine_id(self) -> str:
        return self.wire.machine_id

    def ensure_registered(self, name: str, caps: m.Capabilities) -> str:
        return self.wire.ensure_registered(name, capabilities_pb(caps))

    def heartbeat(self, caps: m.Capabilities | None = None) -> None:
        self.wire.heartbeat(capabilities_pb(caps) if caps is not None else None)

    def lease(self, gpus: Sequence[m.Gpu] = (), gpu_isolation: bool = False,
              enforced: Sequence[str] = ()) -> m.Lease | None:
        """The next task for this machine, or None when none is queued for it."""
        reply = self.wire.lease([gpu_pb(g) for g in gpus], gpu_isolation, enforced)
        return lease_from_pb(reply) if reply.has_task else None

    def renew(self, job_id: str, token: int, phase: str, timeout_s: float) -> m.Renewal:
        r = self.wire.renew(job_id, token, phase, timeout_s)
        return m.Renewal(keep_going=r.keep_going, reason=r.reason, lease_seconds=r.lease_seconds)

    def logs(self, job_id: str, token: int, stream: str, seq: int, text: str) -> bool:
        return self.wire.logs(job_id, token, stream, seq, text)

    def complete(self, job_id: str, token: int, outcome: m.Outcome) -> m.Verdict:
        r = self.wire.complete(pb.CompleteRequest(
            job_id=job_id, fencing_token=token, succeeded=outcome.succeeded,
            exit_code=outcome.exit_code, reason=outcome.reason, result=outcome.result,
            output_uploaded=outcome.output_uploaded, limits=dict(outcome.limits)))
        return m.Verdict(r.accepted, r.reason)

    def begin_checkpoint(self, job_id: str, token: int, epoch: int,
                         size: int) -> m.CheckpointUpload:
        r = self.wire.begin_checkpoint(job_id, token, epoch, size)
        return m.CheckpointUpload(accepted=r.accepted, reason=r.reason, key=r.key,
                                  upload_id=r.upload_id, part_size=r.part_size,
                                  part_urls=tuple(r.part_urls))

    def record_checkpoint(self, job_id: str, token: int, rec: m.CheckpointRecord) -> m.Verdict:
        r = self.wire.record_checkpoint(pb.RecordCheckpointRequest(
            job_id=job_id, fencing_token=token, epoch=rec.epoch, key=rec.key,
            upload_id=rec.upload_id, etags=list(rec.etags), size=rec.size, sha256=rec.sha256))
        return m.Verdict(r.accepted, r.reason)

    def release(self, job_id: str, token: int, reason: str, failed: bool = False) -> m.Verdict:
        r = self.wire.release(job_id, token, reason, failed)
        return m.Verdict(r.accepted, r.reason)

    def next_shard(self, job_id: str, token: int, done: m.ShardResult | None) -> m.NextShard:
        r = self.wire.next_shard(job_id, token, pb.ShardResult(
            index=done.index, succeeded=done.succeeded, exit_code=done.exit_code,
            result_json=done.result_json, reason=done.reason) if done is not None else None)
        return m.NextShard(accepted=r.accepted, reason=r.reason,
                           shard=shard_from_pb(r.shard) if r.has_shard else None)

    def close(self) -> None:
        self.wire.close()


def gpu_pb(g: m.Gpu) -> pb.Gpu:
    return pb.Gpu(uuid=g.uuid, name=g.name, kind=g.kind, memory_total_mb=g.memory_total_mb,
                  memory_free_mb=g.memory_free_mb, compute_capability=g.compute_capability,
                  temperature_c=g.temperature_c, driver_version=g.driver_version,
                  shared_memory=g.shared_memory, minor=g.minor)


def capabilities_pb(c: m.Capabilities) -> pb.Capabilities:
    return pb.Capabilities(runtime=c.runtime, builder=c.builder, cpus=c.cpus,
                           memory_mb=c.memory_mb, limits=dict(c.limits),
                           gpus=[gpu_pb(g) for g in c.gpus], gpu_isolation=c.gpu_isolation,
                           gpu_note=c.gpu_note, speed_gflops=c.speed_gflops)


def shard_from_pb(s: pb.ShardTask) -> m.ShardTask:
    return m.ShardTask(index=s.index, payload_json=s.payload_json, cost=s.cost)


def lease_from_pb(r: pb.LeaseReply) -> m.Lease:
    return m.Lease(
        job_id=r.job_id, attempt=r.attempt, fencing_token=r.fencing_token,
        spec_json=r.spec_json, lease_seconds=r.lease_seconds, context_url=r.context_url,
        output_url=r.output_url,
        datasets=tuple(m.Dataset(d.name, tuple(m.DatasetFile(f.path, f.url, f.size)
                                               for f in d.files)) for d in r.datasets),
        resume=(m.Resume(r.resume.epoch, r.resume.url, r.resume.size, r.resume.sha256)
                if r.HasField("resume") else None),
        gpu_uuids=tuple(r.gpu_uuids), gpu_memory_mb=r.gpu_memory_mb,
        shard=shard_from_pb(r.shard) if r.HasField("shard") else None)
