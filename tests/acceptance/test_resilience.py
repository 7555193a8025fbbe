"""A provider that vanishes costs at most one epoch: real processes, real kills.

Each test brings up its own platform with two agents (both as the provider user), runs the
deterministic examples/train job, and breaks something for real: kill -9 of an agent,
SIGTERM (drain) of an agent, kill -9 of the coordinator.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.agent.client import CoordinatorClient, Membership
from campugrid.agent.messages import Hold
from campugrid.cli.platform import AgentHandle, Platform, ProviderUser
from campugrid.cli.seaweed import EmbeddedS3, free_port
from campugrid.client import Api, Identity, tar_folder
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import pins
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train"
EPOCHS = 8
SPEC = {"env": {"EPOCHS": str(EPOCHS), "EPOCH_SECONDS": "1"}}


def shared_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="campugrid-chaos-"))
    os.chmod(root, 0o711)
    return root


@contextlib.contextmanager
def platform_with(agents: dict[str, tuple[str, ...]],
                  lease_seconds: float = 4.0) -> Iterator[tuple[Platform, Api]]:
    """A platform of its own with these agents (name -> `agent run` arguments); their logs'
    last lines are printed when it stops."""
    root = shared_root()
    p = Platform(root / "state", http_port=free_port(), lease_seconds=lease_seconds,
                 admin_identity=root / "admin.json").start()
    try:
        for name, args in agents.items():
            p.start_agent(name, args=args)
        with p.api() as api:
            yield p, api
    finally:
        p.stop()
        for a in p.agents:
            log = a.state_dir.with_suffix(".log")
            if log.exists():
                print(f"--- {a.name} ---\n" + "\n".join(log.read_text().splitlines()[-25:]))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def two_agents() -> Iterator[tuple[Platform, Api]]:
    with platform_with({"agent-a": (), "agent-b": ()}) as running:
        yield running


def wait_for(what: str, check, timeout: float = 120, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def epochs_by_attempt(api: Api, job_id: str) -> dict[int, list[int]]:
    """The epochs each attempt computed: those its log shows, and those it checkpointed (a
    kill -9 can lose the last log lines an agent had not shipped yet, never a recorded
    checkpoint)."""
    seen: dict[int, set[int]] = {}
    for chunk in api.logs(job_id)["chunks"]:
        if chunk["stream"] != "run":
            continue
        for line in chunk["text"].splitlines():
            if line.startswith("epoch "):
                seen.setdefault(chunk["attempt"], set()).add(int(line.split()[1]))
    for e in api.job(job_id)["events"]:
        if e["kind"] == "checkpoint":
            seen.setdefault(e["attempt"], set()).add(int(e["detail"].split()[1].rstrip(",")))
    return {attempt: sorted(epochs) for attempt, epochs in seen.items()}


def checkpoints_of(api: Api, job_id: str) -> list[int]:
    return [int(e["detail"].split()[1].rstrip(",")) for e in api.job(job_id)["events"]
            if e["kind"] == "checkpoint"]


def holder(p: Platform, api: Api, job_id: str) -> AgentHandle:
    machine = api.job(job_id)["machine_id"]
    return next(a for a in p.agents if a.machine_id() == machine)


def containers(job_id: str) -> list[str]:
    user = ProviderUser.resolve()
    out = subprocess.run(user.command(["podman", "ps", "-a", "--format", "{{.Names}}"]),
                         capture_output=True, text=True, timeout=60).stdout.split()
    return [n for n in out if job_id in n]


def reference_weights(api: Api) -> str:
    job = api.submit(tar_folder(TRAIN), JobSpec.from_dict(SPEC))
    final = api.wait(job["id"], timeout_s=300, poll_s=0.2)
    assert final["state"] == "succeeded", final
    return json.loads(final["result"])["weights_sha256"]


def test_kill_9_of_the_running_agent_resumes_elsewhere_from_the_last_checkpoint(two_agents):
    p, api = two_agents
    expected = reference_weights(api)
    job = api.submit(tar_folder(TRAIN), JobSpec.from_dict(SPEC))["id"]
    wait_for("two checkpoints", lambda: len(checkpoints_of(api, job)) >= 2)
    victim = holder(p, api, job)
    os.kill(victim.pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    # its sandbox does not keep computing beside the replacement
    wait_for("the lost sandbox to be gone", lambda: f"campugrid-{job}-1" not in containers(job),
             timeout=30)
    final = api.wait(job, timeout_s=300, poll_s=0.2)
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 2 and final["machine_id"] != victim.machine_id()
    # bit for bit the model of the uninterrupted run
    assert json.loads(final["result"])["weights_sha256"] == expected
    # at most one epoch computed twice, and the second attempt started from a checkpoint
    by_attempt = epochs_by_attempt(api, job)
    assert by_attempt[2][0] > 0, "the second attempt started from scratch"
    assert len(set(by_attempt[1]) & set(by_attempt[2])) <= 1, by_attempt
    assert sorted(set(by_attempt[1]) | set(by_attempt[2])) == list(range(EPOCHS))
    kinds = [(e["kind"], e["attempt"]) for e in final["events"]]
    assert ("lease_expired", 1) in kinds and ("leased", 2) in kinds
    # the lost agent's late completion is refused and recorded
    lost = CoordinatorClient(Membership.load(victim.state_dir))  # its own key and id
    try:
        late = lost.complete(pb.CompleteRequest(job_id=job, fencing_token=1, succeeded=True,
                                                result="late"))
    finally:
        lost.close()
    assert not late.accepted and "current attempt is 2" in late.reason
    assert api.job(job)["result"] != "late"
    print(f"kill -9 to finished on the other agent: {time.monotonic() - killed_at:.1f} s")


def test_a_drained_agent_hands_over_after_a_final_checkpoint(two_agents):
    p, api = two_agents
    spec = JobSpec.from_dict({**SPEC, "max_attempts": 1})
    job = api.submit(tar_folder(TRAIN), spec)["id"]
    wait_for("a first checkpoint", lambda: len(checkpoints_of(api, job)) >= 1)
    draining = holder(p, api, job)
    os.kill(draining.pid(), signal.SIGTERM)
    draining.proc.wait(timeout=60)  # the agent exits once it has handed the task back
    final = api.wait(job, timeout_s=300, poll_s=0.2)
    assert final["state"] == "succeeded", final
    kinds = [(e["kind"], e["attempt"]) for e in final["events"]]
    assert ("drained", 1) in kinds and ("leased", 2) in kinds
    assert ("lease_expired", 1) not in kinds  # handed back, not abandoned
    run_logs = [c for c in api.logs(job)["chunks"] if c["stream"] == "run"]
    first = "".join(c["text"] for c in run_logs if c["attempt"] == 1)
    second = "".join(c["text"] for c in run_logs if c["attempt"] == 2)
    stopped_at = int(first.split("asked to stop: checkpoint of epoch ")[1].split()[0])
    assert f"resuming from the checkpoint of epoch {stopped_at}" in second
    by_attempt = epochs_by_attempt(api, job)
    assert not set(by_attempt[1]) & set(by_attempt[2]), "a drain must not cost an epoch"


def test_coordinator_kill_9_loses_nothing_and_jobs_finish(tmp_path):
    root = shared_root()
    s3 = EmbeddedS3(root / "s3", "campugrid", "restart-test-secret-0123456789").start()
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "CAMPUGRID_S3_ENDPOINT": s3.endpoint,
           "CAMPUGRID_S3_ACCESS_KEY": s3.access_key, "CAMPUGRID_S3_SECRET_KEY": s3.secret_key}
    argv = [sys.executable, "-m", "campugrid.cli", "coordinator", "serve", "--state-dir",
            str(root / "coord"), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--lease-seconds", "8", "--admin-identity", str(root / "admin.json")]
    coord = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = Platform(root / "agents-only")  # agents only: the coordinator is the subprocess
    api = None
    try:
        wait_for("the coordinator's admin identity", (root / "admin.json").exists, timeout=60)
        api = Api(f"http://127.0.0.1:{http_port}", Identity.load(root / "admin.json"))
        wait_for("the coordinator", lambda: _up(api), timeout=60)
        pin = pins.certificate_fingerprint((root / "coord" / "tls" / "coordinator.crt").read_text())
        agent = p.start_agent("agent-a", coordinator=f"127.0.0.1:{grpc_port}", pin=pin,
                              approve=False)
        api.approve_machine(agent.machine_id())
        jobs = [api.submit(tar_folder(TRAIN), JobSpec.from_dict(
            {"env": {"EPOCHS": "4", "EPOCH_SECONDS": "1"}, "client_job_id": f"restart-{i}"}))["id"]
            for i in range(3)]
        wait_for("a job running", lambda: any(api.job(j)["state"] == "running" for j in jobs))
        coord.kill()  # kill -9: no chance to flush anything
        coord.wait()
        coord = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("the coordinator again", lambda: _up(api), timeout=60)
        assert {j["id"] for j in api.jobs(limit=100)} == set(jobs)  # every acknowledged job
        finals = [api.wait(j, timeout_s=300, poll_s=0.2) for j in jobs]
        assert [f["state"] for f in finals] == ["succeeded"] * 3, finals
    finally:
        if api is not None:
            api.close()
        p.stop()
        coord.kill()
        coord.wait()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)


def _up(api: Api) -> bool:
    try:
        api.jobs(limit=1)
        return True
    except Exception:
        return False


def test_an_agent_that_cannot_renew_stops_its_sandbox_itself(two_agents):
    """Self-fencing: with the coordinator unreachable, the sandbox is gone within about one
    lease, before any replacement could be running, not minutes later."""
    p, api = two_agents
    job = api.submit(tar_folder(TRAIN), JobSpec.from_dict(SPEC))["id"]
    wait_for("the job running", lambda: api.job(job)["state"] == "running")
    wait_for("its container", lambda: containers(job), timeout=30)
    assert p.running is not None
    p.running.grpc_server.stop(grace=0).wait()  # agents can no longer reach the coordinator
    cut = time.monotonic()
    wait_for("the sandbox to stop itself", lambda: not containers(job),
             timeout=p.lease_seconds * 2 + 15)
    stopped_after = time.monotonic() - cut
    assert stopped_after < p.lease_seconds * 2 + 10
    print(f"coordinator unreachable -> sandbox gone: {stopped_after:.1f} s "
          f"(lease {p.lease_seconds:.0f} s)")


SLOW_SHARDS = """
import os, socket, time
from campugrid import hooks
def work(p):
    time.sleep(0.7)
    return {"square": p["i"] ** 2, "sandbox": socket.gethostname()}
hooks.serve_shards(work)
"""


def test_kill_9_during_a_sharded_job_runs_the_lost_shard_elsewhere_once(two_agents, tmp_path):
    p, api = two_agents
    ctx = tmp_path / "slow"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    "COPY work.py /work.py\n")
    (ctx / "work.py").write_text(SLOW_SHARDS)
    count = 16
    job = api.submit(tar_folder(ctx), JobSpec.from_dict({
        "command": ["python3", "/work.py"], "shard_mode": "serve",
        "shards": [{"payload": {"i": i}} for i in range(count)]}))["id"]

    def working_on_both() -> list[dict]:
        """Shards in hand, once both agents' warm sandboxes have finished some."""
        done = {s["machine_id"] for s in api.shards(job, state="succeeded")}
        running = [s for s in api.shards(job, state="running") if s["machine_id"] in done]
        return running if len(done) == 2 and running else []

    held = wait_for("both agents to run shards", working_on_both, every=0.1)
    agents = {a.machine_id(): a for a in p.agents}
    victim_shard = held[0]
    victim = agents[victim_shard["machine_id"]]
    token = next(e for e in api.job(job)["events"] if e["kind"] == "session"
                 and victim.machine_id() in e["detail"])["attempt"]

    def sandbox() -> list[str]:
        return [n for n in containers(job) if n.endswith(f"{job}-{token}")]

    assert sandbox(), "the victim's warm sandbox is not there"
    os.kill(victim.pid(), signal.SIGKILL)
    # The shard it held when it died (it may have finished the one seen above meanwhile):
    # the coordinator still counts it running there until the session's lease expires.
    in_hand = [sh for sh in api.shards(job, state="running")
               if sh["machine_id"] == victim.machine_id()]
    assert in_hand, "the victim held no shard when it was killed"
    victim_shard = in_hand[0]
    wait_for("the lost sandbox to be gone", lambda: not sandbox(), timeout=30)
    final = api.wait(job, timeout_s=300, poll_s=0.2)
    assert final["state"] == "succeeded", final
    shards = list(api.shards(job))
    assert [s["result"]["square"] for s in shards] == [i * i for i in range(count)]
    lost = next(s for s in shards if s["index"] == victim_shard["index"])
    assert lost["tries"] == 1 and lost["machine_id"] != victim.machine_id()
    assert "session_lost" in [e["kind"] for e in final["events"]]
    # the lost session's late result is refused
    client = CoordinatorClient(Membership.load(victim.state_dir))  # its own key and id
    try:
        late = client.next_shard(Hold(job, "session", token), pb.ShardResult(
            index=victim_shard["index"], succeeded=True, result_json='"late"'))
    finally:
        client.close()
    assert not late.accepted and "session is over" in late.reason
    assert next(s for s in api.shards(job) if s["index"] == victim_shard["index"])["result"] != "late"
