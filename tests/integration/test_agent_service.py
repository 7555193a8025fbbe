"""The agents' gRPC service on a real coordinator (SQLite, SeaweedFS), driven by the agent's
own client: authentication, leasing, fencing of stale attempts."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from campugrid.agent.client import hold_fields, hold_from_pb
from campugrid.agent.messages import Hold
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.cli.show import machine_line
from campugrid.client import Api, tar_folder
from campugrid.coordinator import server
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import logs
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER
from tests.support.coordinator import client, with_api

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    with with_api(s3_server, tmp_path, "c", lease_seconds=1.0) as running:
        yield running


def test_a_call_on_a_plain_channel_or_unsigned_is_refused(coordinator, tmp_path):
    running, _ = coordinator
    plain = grpc.insecure_channel(running.grpc_address)  # no TLS: the handshake fails
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.AgentServiceStub(plain).Lease(pb.LeaseRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    m = client(running, tmp_path, "m")
    # The right channel, the right machine id, no signature.
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.AgentServiceStub(m.channel).Lease(
            pb.LeaseRequest(), metadata=((MACHINE_HEADER, m.machine_id),), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not signed" in err.value.details()


def test_the_machine_key_is_private_and_joining_again_is_the_same_machine(coordinator, tmp_path):
    running, _ = coordinator
    first = client(running, tmp_path, "m")
    assert (tmp_path / "m" / "machine.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "m" / "membership.json").stat().st_mode & 0o777 == 0o600
    again = client(running, tmp_path, "m")
    assert again.machine_id == first.machine_id and again.fingerprint == first.fingerprint


def test_a_late_completion_from_a_lost_attempt_is_refused_and_recorded(coordinator, tmp_path,
                                                                         caplog):
    caplog.handler.addFilter(logs.JobFields())
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec(client_job_id="fencing-1"))
    lost, fresh = client(running, tmp_path, "lost"), client(running, tmp_path, "fresh")
    first = lost.lease()
    assert first.has_task and first.job_id == job["id"] and first.fencing_token == 1
    assert first.context_url.startswith("http://127.0.0.1:")
    deadline = time.monotonic() + 30  # lease_seconds=1: the reaper requeues it
    while (second := fresh.lease()).has_task is False:
        assert time.monotonic() < deadline, "the expired lease was not requeued"
        time.sleep(0.2)
    assert second.job_id == job["id"] and second.fencing_token == 2
    late = lost.complete(pb.CompleteRequest(job_id=job["id"], fencing_token=1, succeeded=True,
                                            result="from the lost machine"))
    assert not late.accepted and "current attempt is 2" in late.reason
    # The coordinator's line about it names the job and the attempt, though the line does not.
    [refused] = [r for r in caplog.records if r.getMessage().startswith("completion refused")]
    assert (refused.job_id, refused.attempt) == (job["id"], 1)  # type: ignore[attr-defined]
    assert not lost.renew(Hold(job["id"], "attempt", 1), "running", timeout_s=5).keep_going
    assert fresh.renew(Hold(job["id"], "attempt", 2), "running", timeout_s=5).keep_going
    done = fresh.complete(pb.CompleteRequest(job_id=job["id"], fencing_token=2, succeeded=True,
                                             result="from the fresh machine"))
    assert done.accepted
    final = api.job(job["id"])
    assert final["state"] == "succeeded" and final["result"] == "from the fresh machine"
    kinds = [(e["kind"], e["attempt"]) for e in final["events"]]
    assert ("lease_expired", 1) in kinds and ("refused", 1) in kinds and ("succeeded", 2) in kinds


def test_cancel_tells_the_agent_to_stop(coordinator, tmp_path):
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec())
    c = client(running, tmp_path, "m")
    lease = c.lease()
    api.cancel(job["id"])
    reply = c.renew(hold_from_pb(lease), "running", timeout_s=5)
    assert not reply.keep_going and "cancelled" in reply.reason


def upload(begin: pb.BeginCheckpointReply, data: bytes) -> list[str]:
    import httpx

    etags = []
    for i, url in enumerate(begin.part_urls):
        resp = httpx.put(url, content=data[i * begin.part_size:(i + 1) * begin.part_size])
        resp.raise_for_status()
        etags.append(resp.headers["etag"])
    return etags


def test_checkpoints_are_verified_before_they_are_recorded(coordinator, tmp_path):
    import hashlib

    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec())
    c = client(running, tmp_path, "m")
    lease = c.lease()
    data = b"checkpoint bytes" * 1000
    digest = hashlib.sha256(data).hexdigest()
    begin = c.begin_checkpoint(hold_from_pb(lease), 0, len(data))
    assert begin.accepted and len(begin.part_urls) == 1
    etags = upload(begin, data[:-1] + b"X")  # damaged on the way
    with pytest.raises(grpc.RpcError) as err:
        c.record_checkpoint(pb.RecordCheckpointRequest(
            **hold_fields(hold_from_pb(lease)), epoch=0, key=begin.key,
            upload_id=begin.upload_id, etags=etags, size=len(data), sha256=digest))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "arrived damaged" in err.value.details()
    assert running.coord.store.checkpoints.of(job["id"]) == []
    damaged_key = begin.key
    begin = c.begin_checkpoint(hold_from_pb(lease), 0, len(data))
    assert begin.key != damaged_key  # each upload its own key: nothing recorded is rewritten
    forged = damaged_key.rsplit("-", 1)[0] + "-../x.tar"
    with pytest.raises(grpc.RpcError) as err:
        c.record_checkpoint(pb.RecordCheckpointRequest(
            **hold_fields(hold_from_pb(lease)), epoch=0, key=forged, upload_id=begin.upload_id,
            etags=["x"], size=len(data), sha256=digest))
    assert "does not belong to this attempt" in err.value.details()
    # The name the job's code gave it is shown only, and only as printable text.
    reply = c.record_checkpoint(pb.RecordCheckpointRequest(
        **hold_fields(hold_from_pb(lease)), epoch=0, key=begin.key,
        upload_id=begin.upload_id, etags=upload(begin, data), size=len(data), sha256=digest,
        label="checkpoint-0\x1b[2J" + "x" * 300))
    assert reply.accepted
    recorded = running.coord.store.checkpoints.of(job["id"])
    label = "checkpoint-0[2J" + "x" * 185
    assert [(c.sha256, c.label) for c in recorded] == [(digest, label)]
    assert api.job(job["id"])["checkpoints"][0]["label"] == label
    # the next attempt is told where to resume from
    time.sleep(2.5)  # lease_seconds=1: the reaper requeues it
    other = client(running, tmp_path, "other")
    second = other.lease()
    assert second.fencing_token == 2 and second.resume.epoch == 0
    assert second.resume.sha256 == digest and second.resume.size == len(data)
    # and a checkpoint from the lost attempt is refused
    assert not c.begin_checkpoint(Hold(job["id"], "attempt", 1), 1, 10).accepted


def test_a_gpu_lease_names_the_reserved_gpus_and_waiting_jobs_say_why(coordinator, tmp_path):
    running, api = coordinator
    spec = JobSpec.from_dict({"resources": {"gpus": 1, "gpu_memory_mb": 12 * 1024}})
    job = api.submit(tar_folder(HELLO), spec)
    assert api.job(job["id"])["waiting_reason"] == "no approved machine online"
    c = client(running, tmp_path, "desktop")
    small = [pb.Gpu(uuid="GPU-small", name="RTX 3060", kind="nvidia", memory_free_mb=2048,
                    compute_capability="8.6", minor=0)]
    assert not c.lease(small, gpu_isolation=True).has_task
    assert api.job(job["id"])["waiting_reason"] == "no machine has 12 GB free (most free: desktop, 2 GB)"
    big = [*small, pb.Gpu(uuid="GPU-big", name="RTX 4090", kind="nvidia", memory_free_mb=24000,
                          compute_capability="8.9", minor=1)]
    assert not c.lease(big, gpu_isolation=False).has_task  # no nvproxy: never placed
    lease = c.lease(big, gpu_isolation=True)
    assert lease.has_task and list(lease.gpu_uuids) == ["GPU-big"]
    assert lease.gpu_memory_mb == 12 * 1024
    assert api.job(job["id"])["waiting_reason"] is None


def test_a_job_is_leased_only_to_a_machine_that_enforces_what_it_requires(coordinator, tmp_path):
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict(
        {"resources": {"require_limits": ["sandbox_seccomp"]}}))
    c = client(running, tmp_path, "old", pb.Capabilities(runtime="runsc", builder="buildah", limits={
        "memory": "enforced", "sandbox_seccomp": "not enforced: no seccomp profile"}))
    assert not c.lease(enforced=["memory"]).has_task
    assert api.job(job["id"])["waiting_reason"] == (
        "no online machine enforces sandbox_seccomp (resources.require_limits; 1 online)")
    lease = c.lease(enforced=["memory", "sandbox_seccomp"])
    assert lease.has_task and lease.job_id == job["id"]


def test_a_job_whose_dataset_vanished_fails_at_lease_instead_of_sticking(coordinator, tmp_path):
    running, api = coordinator
    from campugrid.coordinator.objects import S3Store

    data = S3Store(running.coord.settings.s3_endpoint, running.coord.settings.s3_access_key,
                   running.coord.settings.s3_secret_key, "vanishing-data")
    data.ensure_bucket()
    data.put_bytes("d/x.csv", b"1,2")
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict(
        {"datasets": [{"name": "d", "uri": "s3://vanishing-data/d/",
                       "sha256": {"x.csv": hashlib.sha256(b"1,2").hexdigest()}}]}))
    data.delete("d/x.csv")
    data.close()
    c = client(running, tmp_path, "m")
    assert not c.lease().has_task
    final = api.job(job["id"])
    assert final["state"] == "failed" and final["reason"].startswith("cannot start: dataset d")


def sharded_job(api: Api, costs: list[float]) -> str:
    spec = JobSpec.from_dict({"command": ["python3", "x.py"],
                              "shards": [{"payload": {"i": i}, "cost": c}
                                         for i, c in enumerate(costs)]})
    return str(api.submit(tar_folder(HELLO), spec)["id"])


def test_shards_over_grpc_results_checked_and_heavy_ones_to_the_faster_machine(coordinator, tmp_path):
    running, api = coordinator
    job_id = sharded_job(api, [1, 7, 3])
    slow = client(running, tmp_path, "slow", pb.Capabilities(runtime="runsc", speed_gflops=10.0))
    fast = client(running, tmp_path, "fast", pb.Capabilities(runtime="runsc", speed_gflops=200.0))
    lease_fast, lease_slow = fast.lease(), slow.lease()
    assert lease_fast.HasField("shard") and lease_slow.HasField("shard")
    assert (lease_fast.shard.cost, lease_slow.shard.cost) == (7, 1)
    assert lease_fast.output_url == ""  # shards report results, not output folders
    token = hold_from_pb(lease_fast)
    assert token.kind == "session"
    # what the agent relays from the sandbox is checked: JSON, bounded
    with pytest.raises(grpc.RpcError) as e:
        fast.next_shard(token, pb.ShardResult(index=lease_fast.shard.index,
                                                      succeeded=True, result_json="{not json"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        fast.next_shard(token, pb.ShardResult(index=lease_fast.shard.index,
                                                      succeeded=True,
                                                      result_json='"' + "x" * 70_000 + '"'))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:  # nested too deeply to parse
        fast.next_shard(token, pb.ShardResult(index=lease_fast.shard.index,
                                                      succeeded=True,
                                                      result_json="[" * 30_000 + "]" * 30_000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a result for a shard this session does not hold is refused
    other = fast.next_shard(token, pb.ShardResult(index=lease_slow.shard.index,
                                                          succeeded=True, result_json="1"))
    assert not other.accepted and "does not hold it" in other.reason
    # shard sessions do not checkpoint; a session is not a plain job's attempt
    with pytest.raises(grpc.RpcError) as e:
        fast.begin_checkpoint(token, 1, 10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        fast.next_shard(Hold(job_id, "attempt", token.token), None)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not fast.renew(Hold(job_id, "attempt", token.token), "running", 5).keep_going
    with pytest.raises(grpc.RpcError) as e:  # a kind this coordinator does not know
        fast.stub.Renew(pb.RenewRequest(job_id=job_id, fencing_token=token.token, hold_kind=7,
                                        phase="running"), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hold_kind" in e.value.details()
    nxt = fast.next_shard(token, pb.ShardResult(index=lease_fast.shard.index,
                                                        succeeded=True, result_json='{"ok": 1}'))
    assert nxt.accepted and nxt.has_shard and nxt.shard.cost == 3
    assert fast.renew(token, "running", 5).keep_going
    done = fast.next_shard(token, pb.ShardResult(index=nxt.shard.index, succeeded=True,
                                                         result_json="2"))
    assert done.accepted and not done.has_shard
    assert fast.complete(pb.CompleteRequest(**hold_fields(token), succeeded=True)).accepted
    # the slow machine's shard is still its own; once it reports, the job is done
    last = slow.next_shard(hold_from_pb(lease_slow),
                           pb.ShardResult(index=lease_slow.shard.index, succeeded=True,
                                          result_json="3"))
    assert last.accepted and not last.has_shard
    job = api.job(job_id)
    assert job["state"] == "succeeded" and job["shards"] == {
        "total": 3, "queued": 0, "running": 0, "done": 3, "failed": 0}
    assert [s["result"] for s in api.shards(job_id)] == [3, {"ok": 1}, 2]


def test_a_lost_session_is_requeued_and_its_late_result_refused(coordinator, tmp_path):
    running, api = coordinator  # leases of 1 s
    job_id = sharded_job(api, [1])
    lost, other = client(running, tmp_path, "lost"), client(running, tmp_path, "other")
    first = lost.lease()
    assert first.HasField("shard")
    deadline = time.monotonic() + 15
    second = other.lease()
    while not second.has_task and time.monotonic() < deadline:
        time.sleep(0.2)
        second = other.lease()
    assert second.has_task and second.shard.index == first.shard.index
    late = lost.next_shard(hold_from_pb(first),
                           pb.ShardResult(index=first.shard.index, succeeded=True, result_json="1"))
    assert not late.accepted and "session is over" in late.reason
    assert not lost.renew(hold_from_pb(first), "running", 5).keep_going
    kinds = [e["kind"] for e in api.job(job_id)["events"]]
    assert "session_lost" in kinds


def test_a_machine_its_owner_holds_is_listed_so_and_queued_jobs_say_why(coordinator, tmp_path):
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec())
    c = client(running, tmp_path, "gamer-pc")
    held = "its owner's program steam started\x00\x1b[31m" + "x" * 1000
    c.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah", held=held))
    why = api.job(job["id"])["waiting_reason"]
    assert why.startswith("every approved machine online (1) is held by its owner now: "
                          "its owner's program steam started")
    assert "\x00" not in why and "\x1b" not in why and len(why) < 500  # the agent's words, bounded
    [m] = [m for m in api.machines() if m["id"] == c.machine_id]
    assert m["held"].startswith("its owner's program steam started")
    c.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah"))  # the game is closed
    assert api.job(job["id"])["waiting_reason"] == "waiting for a machine that fits to ask for work"
    assert [m["held"] for m in api.machines() if m["id"] == c.machine_id] == [""]


def test_gpu_memory_reported_by_heartbeats_is_kept_by_the_minute_and_charted_to_one_scale(
        coordinator, tmp_path):
    from campugrid.console import charts

    running, _ = coordinator
    c = client(running, tmp_path, "rig")
    gpus = [pb.Gpu(uuid="GPU-big", name="RTX 4090", kind="nvidia", memory_total_mb=24_000,
                   memory_free_mb=18_000, compute_capability="8.9"),
            pb.Gpu(uuid="GPU-small", name="RTX 3060", kind="nvidia", memory_total_mb=12_000,
                   memory_free_mb=12_000, compute_capability="8.6"),
            pb.Gpu(uuid="apple", name="M2 Max", kind="apple", memory_total_mb=64_000,
                   memory_free_mb=40_000, shared_memory=True)]
    c.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah", gpus=gpus))
    gpus[0].memory_free_mb = 1  # later in the same minute: one row per minute stands
    c.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah", gpus=gpus))
    found = {h.uuid: h for h in running.coord.store.gpu_history.since(60)
             if h.machine_id == c.machine_id}
    assert set(found) == {"GPU-big", "GPU-small", "apple"}
    [big] = found["GPU-big"].samples
    assert (big.total_mb, big.free_mb, big.outside_mb) == (24_000, 18_000, 6_000)
    assert found["apple"].shared and not found["GPU-big"].shared
    drawn = {ch.name: ch for ch in charts.charts(list(found.values()))}
    assert charts.scale_mb(list(found.values())) == 24_000  # unified memory is not counted
    height = {n: float(str(ch.svg).split('height="', 1)[1].split('"')[0]) for n, ch in drawn.items()}
    assert height["RTX 4090"] == 2 * height["RTX 3060"]  # one scale for every GPU
    assert 'class="mem shared"' in str(drawn["M2 Max"].svg)
    assert 'data-mb="6000"' in str(drawn["RTX 4090"].svg)
    assert running.coord.store.gpu_history.prune(keep_minutes=-1) == 3
    stranger = client(running, tmp_path, "stranger", approve=False)  # pending: not charted
    stranger.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah", gpus=[
        pb.Gpu(uuid="GPU-huge", name="x", kind="nvidia", memory_total_mb=2**62)]))
    assert [h for h in running.coord.store.gpu_history.since(60)
            if h.machine_id == stranger.machine_id] == []


def test_a_lease_takes_only_a_job_that_fits_the_room_the_machine_reports(coordinator, tmp_path):
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"resources": {"cpus": 4}}))
    c = client(running, tmp_path, "two-cores")
    c.heartbeat(pb.Capabilities(runtime="runsc go-20260905-160fafc42237", builder="buildah",
                                cpus=2, memory_mb=8192, disk_mb=30_000))
    assert not c.lease(room=(2, 8192, 30_000)).has_task
    assert api.job(job["id"])["waiting_reason"] == (
        "needs 4 CPUs; the one online machine has 2 CPUs")
    [m] = [m for m in api.machines() if m["id"] == c.machine_id]
    assert (m["cpus"], m["disk_mb"], m["online"], m["busy"]) == (2, 30_000, True, "")
    # Its gVisor, as the agent said it, in REST and on `campugrid machines`' line.
    assert m["runtime"] == "runsc go-20260905-160fafc42237"
    assert m["runtime"] in machine_line(m).splitlines()[1]
    lease = c.lease(room=(8, 8192, 30_000))
    assert lease.has_task and lease.job_id == job["id"]
    [m] = [m for m in api.machines() if m["id"] == c.machine_id]
    assert (m["online"], m["busy"]) == (True, job["id"][:8])  # busy, not offline


def test_what_an_agent_says_its_output_holds_is_kept_bounded_and_printable(coordinator, tmp_path):
    running, api = coordinator
    job = api.submit(tar_folder(HELLO), JobSpec())
    c = client(running, tmp_path, "lister")
    lease = c.lease()
    assert lease.has_task and lease.job_id == job["id"]
    running.coord.objects.put_bytes(running.coord.leasing.output_key(job["id"], lease.attempt), b"tgz")
    files = [pb.OutputFile(path=f"f{i}\x1b[31m" + "x" * 400, size=i) for i in range(300)]
    assert c.complete(pb.CompleteRequest(**hold_fields(hold_from_pb(lease)),
                                         succeeded=True, output_uploaded=True,
                                         output_files=files)).accepted
    listed = api.job(job["id"])["output_files"]
    assert len(listed) == 200 and listed[3][1] == 3
    assert all(len(p) <= 256 and p.isprintable() for p, _ in listed)
    assert listed[0][0].startswith("f0?[31mxxx")


def test_an_agent_from_before_hold_kinds_works_its_session_by_the_token_alone(coordinator,
                                                                              tmp_path):
    """An agent that does not say it names holds by kind (LeaseRequest.hold_kinds) gets a
    session's token the old way, offset by 2^40, and its calls, which carry no kind, are
    read that way: a fleet updates machine by machine."""
    running, api = coordinator
    job_id = sharded_job(api, [1])
    old = client(running, tmp_path, "old")
    lease = old.stub.Lease(pb.LeaseRequest(), timeout=10)
    assert lease.has_task and lease.hold_kind == pb.SESSION
    assert lease.fencing_token == (1 << 40) + int(next(
        e["attempt"] for e in api.job(job_id)["events"] if e["kind"] == "session"))
    assert old.stub.Renew(pb.RenewRequest(job_id=job_id, fencing_token=lease.fencing_token,
                                          phase="running"), timeout=5).keep_going
    done = old.stub.NextShard(pb.NextShardRequest(
        job_id=job_id, fencing_token=lease.fencing_token,
        done=pb.ShardResult(index=lease.shard.index, succeeded=True, result_json="1")), timeout=5)
    assert done.accepted and not done.has_shard
    assert old.stub.Complete(pb.CompleteRequest(job_id=job_id, fencing_token=lease.fencing_token,
                                                succeeded=True), timeout=5).accepted
    assert api.job(job_id)["state"] == "succeeded"
