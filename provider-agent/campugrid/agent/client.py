"""The agent's side of the gRPC protocol, and this machine's identity on its coordinator.

Two layers: CoordinatorClient is the wire (protobuf in and out, as the coordinator's service
tests use it); CoordinatorApi is what the agent's code talks to, in frozen values
(campugrid.agent.messages), converted here and nowhere else.

The channel is TLS to the one certificate pinned at join (`Membership`), and every call is
signed with the machine's own Ed25519 key (campugrid.protocol.wire); no secret is shared.
A membership may name several coordinator processes (`HOST:PORT,HOST:PORT`, one database,
one certificate): a call that finds one gone sends the next call to the next.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from campugrid.agent import messages as m
from campugrid.agent.link import Waiting
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import keys, pins
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.wire import (  # signed_metadata: also for the tests and benches
    CHANNEL_OPTIONS,
    KEY_HEADER,
    MACHINE_HEADER,
    signed_metadata,
)

RPC_TIMEOUT_S = 10.0
DEFAULT_GRPC_PORT = 8751
# What says a coordinator process is gone (or cut off), not that it refused the call.
FAILOVER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A coordinator that could not be reached is passed over this long when another one is only
# slow: a call that runs out of time on a live coordinator must not send the agent back to
# a dead one (its renewals would fail there until the lease fences the job).
DOWN_S = 15.0
log = logging.getLogger("campugrid.agent.client")


@dataclasses.dataclass(frozen=True)
class Membership:
    """What `campugrid agent join` keeps in the agent's state folder: the coordinator's
    address, the pinned certificate, this machine's key file and (once registered) its id."""

    state_dir: Path
    coordinator: str
    pin: str
    certificate: str  # PEM, checked against `pin` when it was fetched
    machine_id: str = ""

    @property
    def key_file(self) -> Path:
        return self.state_dir / "machine.key"

    @property
    def addresses(self) -> list[str]:
        return split_addresses(self.coordinator)

    @staticmethod
    def file(state_dir: Path) -> Path:
        return state_dir / "membership.json"

    @classmethod
    def load(cls, state_dir: Path) -> Membership | None:
        try:
            raw = json.loads(cls.file(state_dir).read_text())
            return cls(state_dir, str(raw["coordinator"]), str(raw["pin"]),
                       str(raw["certificate"]), str(raw.get("machine_id") or ""))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def join(cls, state_dir: Path, coordinator: str, pin: str) -> Membership:
        """Fetch the coordinator's certificate, check it against `pin`, keep both, and make
        this machine's key if it has none. Joining the same coordinator again keeps the key."""
        pem = _fetch_any(split_addresses(coordinator), pin)
        known = cls.load(state_dir)
        same = known is not None and known.coordinator == coordinator and known.pin == pin.strip()
        joined = cls(state_dir, coordinator, pin.strip(), pem,
                     known.machine_id if same and known is not None else "")
        keys.load_or_create(joined.key_file)
        joined.save()
        return joined

    def with_machine(self, machine_id: str) -> Membership:
        updated = dataclasses.replace(self, machine_id=machine_id)
        updated.save()
        return updated

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.file(self.state_dir)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"coordinator": self.coordinator, "pin": self.pin,
                       "certificate": self.certificate, "machine_id": self.machine_id}, f)
        os.replace(tmp, path)


def split_addresses(coordinator: str) -> list[str]:
    """The coordinator processes a membership names (comma-separated), in order."""
    found = [a.strip() for a in coordinator.split(",") if a.strip()]
    if not found:
        raise CampugridError("no coordinator address given (HOST:PORT, or several joined by commas)")
    return found


def _fetch_any(addresses: list[str], pin: str) -> str:
    """The pinned certificate from the first coordinator that answers (they share it)."""
    problems = []
    for address in addresses:
        host, port = pins.split_address(address, DEFAULT_GRPC_PORT)
        try:
            return pins.fetch_pinned(host, port, pin)
        except pins.PinMismatch:
            raise
        except CampugridError as e:
            problems.append(str(e))
    raise CampugridError("; ".join(problems))


def pinned_channel(address: str, certificate: str) -> grpc.Channel:
    """A TLS channel that trusts only the pinned coordinator certificate."""
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate.encode())
    return grpc.secure_channel(address, credentials, options=list(CHANNEL_OPTIONS))


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class _SignCalls(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Signs every call: method, SHA-256 of the request's bytes, time, nonce, and who signs
    (the machine id, or for Register the public key being registered)."""

    def __init__(self, key: keys.Ed25519PrivateKey, signer: Callable[[str], tuple[str, str, str]]) -> None:
        self.key = key
        self.signer = signer

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        header, value, signer = self.signer(details.method)
        metadata = [*(details.metadata or ()), (header, value),
                    *signed_metadata(self.key, details.method, request.SerializeToString(),
                                     signer)]
        return continuation(_Details(details.method, details.timeout, metadata,
                                     details.credentials, details.wait_for_ready,
                                     details.compression), request)


class _Failover(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Tells the client when a call found its coordinator gone (not when it was refused)."""

    def __init__(self, client: CoordinatorClient, index: int) -> None:
        self.client = client
        self.index = index

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        # At once for a blocking call (done already); when it ends for a held one (`.future`)
        outcome.add_done_callback(self._ended)
        return outcome

    def _ended(self, outcome: Any) -> None:
        code = outcome.code()
        if code in FAILOVER:
            self.client.failed(self.index, code)


class CoordinatorClient:
    """The gRPC stub, over pinned TLS, signing with this machine's key: protobuf in and out.
    With several coordinator addresses, a call that finds its coordinator unreachable moves
    the client on to the next one (the caller's own retry then goes there)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.addresses = membership.addresses
        self.key = keys.load_private(membership.key_file)
        self.public_key = keys.public_text(self.key)
        self.fingerprint = keys.key_fingerprint(self.key)
        self.machine_id = membership.machine_id
        self.channels = [pinned_channel(a, membership.certificate) for a in self.addresses]
        self._stubs = [pb_grpc.AgentServiceStub(grpc.intercept_channel(
            channel, _SignCalls(self.key, self._signer), _Failover(self, i)))
            for i, channel in enumerate(self.channels)]
        self._current = 0
        self._down: dict[int, float] = {}  # when each coordinator was last found unreachable
        self._lock = threading.Lock()
        # An idle machine's stream, where it waits for work (opened when first wanted).
        self.waiting = Waiting(lambda: self.address, membership.certificate, self.key,
                               lambda: self.machine_id,
                               unreachable=lambda: self.failed(self._current,
                                                               grpc.StatusCode.UNAVAILABLE))

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    @property
    def stub(self) -> pb_grpc.AgentServiceStub:
        return self._stubs[self._current]

    @property
    def channel(self) -> grpc.Channel:
        return self.channels[self._current]

    def failed(self, index: int, code: grpc.StatusCode) -> None:
        """The coordinator at `index` did not answer: the next call goes to the next one
        not found unreachable in the last DOWN_S seconds. If every other one was, a slow
        coordinator is kept; an unreachable one is left for the next in turn."""
        now = time.monotonic()
        with self._lock:
            if code is grpc.StatusCode.UNAVAILABLE:
                self._down[index] = now
            if len(self._stubs) == 1 or index != self._current:
                return  # another thread moved on already
            others = [(index + k) % len(self._stubs) for k in range(1, len(self._stubs))]
            up = [i for i in others if now - self._down.get(i, -math.inf) >= DOWN_S]
            if not up and code is not grpc.StatusCode.UNAVAILABLE:
                log.warning("coordinator %s did not answer in time; staying with it (the others "
                            "were unreachable in the last %.0f s)", self.addresses[index], DOWN_S)
                return
            self._current = (up or others)[0]
        log.warning("coordinator %s unreachable (%s); trying %s", self.addresses[index],
                    code.name, self.address)

    def _signer(self, method: str) -> tuple[str, str, str]:
        if method.endswith("/Register"):
            return KEY_HEADER, self.public_key, f"key:{self.public_key}"
        return MACHINE_HEADER, self.machine_id, self.machine_id

    def register(self, name: str, caps: pb.Capabilities | None = None) -> pb.RegisterReply:
        """Register this machine's key (the same key again is the same machine): its id and
        whether its owner approved it yet."""
        reply: pb.RegisterReply = self.stub.Register(
            pb.RegisterRequest(name=name, capabilities=caps), timeout=RPC_TIMEOUT_S)
        self.machine_id = reply.machine_id
        if reply.machine_id != self.membership.machine_id:
            self.membership = self.membership.with_machine(reply.machine_id)
        return reply

    def ensure_registered(self, name: str, caps: pb.Capabilities) -> str:
        return self.register(name, caps).machine_id

    def heartbeat(self, caps: pb.Capabilities | None = None) -> None:
        if self.waiting.heartbeat(caps):
            return  # on the stream
        req = pb.HeartbeatRequest(capabilities=caps) if caps is not None else pb.HeartbeatRequest()
        self.stub.Heartbeat(req, timeout=RPC_TIMEOUT_S)

    def lease(self, gpus: Sequence[pb.Gpu] = (), gpu_isolation: bool = False,
              enforced: Sequence[str] = (), shares: Sequence[str] = (), wait_s: float = 0.0,
              give_up: Callable[[], bool] | None = None,
              room: tuple[int, int, int] = (0, 0, 0)) -> pb.LeaseReply:
        """The next task that fits `room` (CPUs, memory and disk in MB; 0: not said). With
        `wait_s`, the machine waits that long on its stream (link.Waiting) for the lease the
        coordinator sends when work comes; `give_up`, asked twice a second meanwhile, ends the
        wait early (no task then); a refused stream raises link.Refused (a grpc.RpcError).
        Without, one Lease call claims at once, or says there is none (tools and tests)."""
        cpus, memory_mb, disk_mb = room
        request = pb.LeaseRequest(gpus=gpus, gpu_isolation=gpu_isolation, enforced_limits=enforced,
                                  shares=shares, cpus=cpus, memory_mb=memory_mb,
                                  disk_mb=disk_mb, hold_kinds=True)
        if wait_s > 0:
            got = self.waiting.wait(request, wait_s, give_up)
            return got if got is not None else pb.LeaseReply(has_task=False)
        reply: pb.LeaseReply = self.stub.Lease(request, timeout=RPC_TIMEOUT_S)
        return reply

    def renew(self, hold: m.Hold, phase: str, timeout_s: float) -> pb.RenewReply:
        reply: pb.RenewReply = self.stub.Renew(pb.RenewRequest(**hold_fields(hold), phase=phase),
                                               timeout=timeout_s)
        return reply

    def logs(self, hold: m.Hold, stream: str, seq: int, text: str) -> bool:
        reply = self.stub.ReportLogs(
            pb.LogsRequest(**hold_fields(hold), stream=stream, seq=seq, text=text),
            timeout=RPC_TIMEOUT_S)
        return bool(reply.accepted)

    def complete(self, req: pb.CompleteRequest) -> pb.CompleteReply:
        reply: pb.CompleteReply = self.stub.Complete(req, timeout=RPC_TIMEOUT_S)
        return reply

    def begin_checkpoint(self, hold: m.Hold, epoch: int, size: int) -> pb.BeginCheckpointReply:
        reply: pb.BeginCheckpointReply = self.stub.BeginCheckpoint(
            pb.BeginCheckpointRequest(**hold_fields(hold), epoch=epoch, size=size),
            timeout=RPC_TIMEOUT_S)
        return reply

    def record_checkpoint(self, req: pb.RecordCheckpointRequest) -> pb.RecordCheckpointReply:
        # Generous: the coordinator reads the object back to check its digest.
        reply: pb.RecordCheckpointReply = self.stub.RecordCheckpoint(req,
                                                                     timeout=300)
        return reply

    def release(self, hold: m.Hold, reason: str, failed: bool = False,
                cannot_run_here: bool = False) -> pb.ReleaseReply:
        reply: pb.ReleaseReply = self.stub.Release(
            pb.ReleaseRequest(**hold_fields(hold), reason=reason, failed=failed,
                              cannot_run_here=cannot_run_here),
            timeout=RPC_TIMEOUT_S)
        return reply

    def next_shard(self, hold: m.Hold, done: pb.ShardResult | None) -> pb.NextShardReply:
        reply: pb.NextShardReply = self.stub.NextShard(
            pb.NextShardRequest(**hold_fields(hold), done=done), timeout=RPC_TIMEOUT_S)
        return reply

    def image(self, req: pb.ImageRequest) -> pb.ImageReply:
        # Generous: a "pushed" step has the coordinator look the manifest up in the registry.
        reply: pb.ImageReply = self.stub.Image(req, timeout=RPC_TIMEOUT_S * 2)
        return reply

    def close(self) -> None:
        self.waiting.close()
        for channel in self.channels:
            channel.close()


def fetch_membership(state_dir: Path, coordinator: str | None, pin: str | None) -> Membership:
    """The membership an agent runs with: the one `join` stored, or a new join when given a
    pin (and a coordinator other than the stored one needs its pin)."""
    known = Membership.load(state_dir)
    if pin:
        return Membership.join(state_dir, coordinator or (known.coordinator if known else ""), pin)
    if known is None:
        raise CampugridError(f"this agent has not joined a coordinator ({state_dir}): run "
                             "`campugrid agent join SERVER --pin FINGERPRINT` first (the "
                             "coordinator's operator prints that command)")
    if coordinator and coordinator != known.coordinator:
        raise CampugridError(f"this agent joined {known.coordinator}, not {coordinator}: join "
                             "the new one with its --pin")
    return known


class CoordinatorApi:
    """The coordinator, as the agent's code sees it: frozen values in and out."""

    def __init__(self, wire: CoordinatorClient) -> None:
        self.wire = wire

    @property
    def machine_id(self) -> str:
        return self.wire.machine_id

    @property
    def address(self) -> str:
        """The coordinator the next call goes to."""
        return self.wire.address

    def ensure_registered(self, name: str, caps: m.Capabilities) -> str:
        return self.wire.ensure_registered(name, capabilities_pb(caps))

    def heartbeat(self, caps: m.Capabilities | None = None) -> None:
        self.wire.heartbeat(capabilities_pb(caps) if caps is not None else None)

    def lease(self, gpus: Sequence[m.Gpu] = (), gpu_isolation: bool = False,
              enforced: Sequence[str] = (), shares: Sequence[str] = (), wait_s: float = 0.0,
              give_up: Callable[[], bool] | None = None,
              room: m.Room | None = None) -> m.Lease | None:
        """The next task for this machine, or None when none is queued for it (after up to
        `wait_s` of waiting for one, unless `give_up` says so first)."""
        reply = self.wire.lease([gpu_pb(g) for g in gpus], gpu_isolation, enforced, shares,
                                wait_s, give_up, (room.cpus, room.memory_mb, room.disk_mb)
                                if room is not None else (0, 0, 0))
        return lease_from_pb(reply) if reply.has_task else None

    def renew(self, hold: m.Hold, phase: str, timeout_s: float) -> m.Renewal:
        r = self.wire.renew(hold, phase, timeout_s)
        return m.Renewal(keep_going=r.keep_going, reason=r.reason, lease_seconds=r.lease_seconds)

    def logs(self, hold: m.Hold, stream: str, seq: int, text: str) -> bool:
        return self.wire.logs(hold, stream, seq, text)

    def complete(self, hold: m.Hold, outcome: m.Outcome) -> m.Verdict:
        r = self.wire.complete(pb.CompleteRequest(
            **hold_fields(hold), succeeded=outcome.succeeded,
            exit_code=outcome.exit_code, reason=outcome.reason, result=outcome.result,
            output_uploaded=outcome.output_uploaded, limits=dict(outcome.limits),
            output_files=[pb.OutputFile(path=p, size=n) for p, n in outcome.output_files[:200]]))
        return m.Verdict(r.accepted, r.reason)

    def begin_checkpoint(self, hold: m.Hold, epoch: int, size: int) -> m.CheckpointUpload:
        r = self.wire.begin_checkpoint(hold, epoch, size)
        return m.CheckpointUpload(accepted=r.accepted, reason=r.reason, key=r.key,
                                  upload_id=r.upload_id, part_size=r.part_size,
                                  part_urls=tuple(r.part_urls))

    def record_checkpoint(self, hold: m.Hold, rec: m.CheckpointRecord) -> m.Verdict:
        r = self.wire.record_checkpoint(pb.RecordCheckpointRequest(
            **hold_fields(hold), epoch=rec.epoch, key=rec.key,
            upload_id=rec.upload_id, etags=list(rec.etags), size=rec.size, sha256=rec.sha256,
            label=rec.label))
        return m.Verdict(r.accepted, r.reason)

    def release(self, hold: m.Hold, reason: str, failed: bool = False,
                cannot_run_here: bool = False) -> m.Verdict:
        """Hand the task back: drained, `failed` here (the attempt counts), or this machine
        `cannot_run_here` (it does not count, and the job is not offered here again)."""
        r = self.wire.release(hold, reason, failed, cannot_run_here)
        return m.Verdict(r.accepted, r.reason)

    def next_shard(self, hold: m.Hold, done: m.ShardResult | None) -> m.NextShard:
        r = self.wire.next_shard(hold, pb.ShardResult(
            index=done.index, succeeded=done.succeeded, exit_code=done.exit_code,
            result_json=done.result_json, reason=done.reason) if done is not None else None)
        return m.NextShard(accepted=r.accepted, reason=r.reason,
                           shard=shard_from_pb(r.shard) if r.has_shard else None)

    def image(self, hold: m.Hold, step: str, inputs_json: str, digest: str = "") -> m.ImageStep:
        r = self.wire.image(pb.ImageRequest(**hold_fields(hold), step=step, inputs_json=inputs_json,
                                            digest=digest))
        return m.ImageStep(accepted=r.accepted, reason=r.reason, action=r.action,
                           registry=r.registry, repository=r.repository, digest=r.digest,
                           token=r.token, push=r.push, retry_seconds=r.retry_seconds,
                           built_by=r.built_by)

    def close(self) -> None:
        self.wire.close()


HOLD_KINDS = {"attempt": pb.ATTEMPT, "session": pb.SESSION}


def hold_fields(hold: m.Hold) -> dict[str, Any]:
    """The fields that name a hold in every call about it."""
    return {"job_id": hold.job_id, "fencing_token": hold.token,
            "hold_kind": HOLD_KINDS[hold.kind]}


def gpu_pb(g: m.Gpu) -> pb.Gpu:
    return pb.Gpu(uuid=g.uuid, name=g.name, kind=g.kind, memory_total_mb=g.memory_total_mb,
                  memory_free_mb=g.memory_free_mb, compute_capability=g.compute_capability,
                  temperature_c=g.temperature_c, driver_version=g.driver_version,
                  shared_memory=g.shared_memory, minor=g.minor)


def capabilities_pb(c: m.Capabilities) -> pb.Capabilities:
    return pb.Capabilities(runtime=c.runtime, builder=c.builder, cpus=c.cpus,
                           memory_mb=c.memory_mb, limits=dict(c.limits),
                           gpus=[gpu_pb(g) for g in c.gpus], gpu_isolation=c.gpu_isolation,
                           gpu_note=c.gpu_note, speed_gflops=c.speed_gflops, held=c.held,
                           disk_mb=c.disk_mb,
                           shares=[pb.Share(name=name, files=[
                               pb.Share.File(path=f.path, size=f.size, sha256=f.sha256)
                               for f in files]) for name, files in sorted(c.shares.items())])


def shard_from_pb(s: pb.ShardTask) -> m.ShardTask:
    return m.ShardTask(index=s.index, payload_json=s.payload_json, cost=s.cost)


def hold_from_pb(r: pb.LeaseReply) -> m.Hold:
    """The hold a lease gives (as Lease.hold, for callers of the wire client)."""
    return m.Hold(r.job_id, {v: k for k, v in HOLD_KINDS.items()}.get(r.hold_kind, "attempt"),
                  r.fencing_token)


def lease_from_pb(r: pb.LeaseReply) -> m.Lease:
    return m.Lease(
        job_id=r.job_id, attempt=r.attempt, fencing_token=r.fencing_token,
        spec_json=r.spec_json, lease_seconds=r.lease_seconds, context_url=r.context_url,
        output_url=r.output_url,
        datasets=tuple(m.Dataset(d.name, tuple(m.DatasetFile(f.path, f.url, f.size, f.sha256)
                                               for f in d.files), d.share) for d in r.datasets),
        resume=(m.Resume(r.resume.epoch, r.resume.url, r.resume.size, r.resume.sha256)
                if r.HasField("resume") else None),
        gpu_uuids=tuple(r.gpu_uuids), gpu_memory_mb=r.gpu_memory_mb,
        shard=shard_from_pb(r.shard) if r.HasField("shard") else None,
        bases=tuple(m.BaseImage(b.ref, b.digest, tuple(m.Source(s.address, s.insecure, s.token)
                                                        for s in b.sources)) for b in r.bases),
        mirrors=tuple(m.Mirror(x.kind, x.url, x.token, x.certificate) for x in r.mirrors),
        hold_kind=hold_from_pb(r).kind)
