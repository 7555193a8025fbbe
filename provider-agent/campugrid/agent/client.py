"""The agent's side of the gRPC protocol, and its stored machine credentials."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol.wire import MACHINE_HEADER, SECRET_HEADER

RPC_TIMEOUT_S = 10.0


class CoordinatorClient:
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
