"""Two coordinator processes on one PostgreSQL, two agents that know both: kill -9 of one
coordinator mid-run, and every job it acknowledged still finishes, exactly once.

The coordinators share one state folder (the certificate agents pin, console.key), as the
README's deployment says; the first to start leads the lease reaper, the other takes over
when it dies.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import EmbeddedS3, free_port
from campugrid.client import Api, Identity, tar_folder
from campugrid.protocol import pins
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.spec import JobSpec
from tests.acceptance.test_resilience import TRAIN, _up, epochs_by_attempt, shared_root, wait_for

pytestmark = pytest.mark.acceptance
EPOCHS = 5
SPEC = {"env": {"EPOCHS": str(EPOCHS), "EPOCH_SECONDS": "1"}}
# The jobs submitted around the kill must be acknowledged, stored and run once; being at work
# when it comes is the first four's part (two run, two wait): the later ones' epochs are short.
LATER = {"env": {"EPOCHS": str(EPOCHS), "EPOCH_SECONDS": "0.2"}}


class Coordinators:
    """`campugrid coordinator serve` processes on one database and one state folder."""

    def __init__(self, root: Path, database: str, s3: EmbeddedS3) -> None:
        self.root = root
        self.env = {**os.environ, "CAMPUGRID_DATABASE_URL": database,
                    "CAMPUGRID_S3_ENDPOINT": s3.endpoint, "CAMPUGRID_S3_ACCESS_KEY": s3.access_key,
                    "CAMPUGRID_S3_SECRET_KEY": s3.secret_key}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, tuple[int, int]] = {}

    def start(self, name: str) -> Api:
        http_port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "campugrid.cli", "coordinator", "serve",
                "--state-dir", str(self.root / "coord"), "--http-port", str(http_port),
                "--grpc-port", str(grpc_port), "--admin-identity", str(self.root / "admin.json")]
        with open(self.log(name), "wb") as log:
            self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log)
        self.ports[name] = (http_port, grpc_port)
        wait_for(f"coordinator {name}'s admin identity", (self.root / "admin.json").exists, timeout=60)
        api = self.api(name)
        wait_for(f"coordinator {name}", lambda: _up(api), timeout=60)
        return api

    def api(self, name: str) -> Api:
        return Api(f"http://127.0.0.1:{self.ports[name][0]}", Identity.load(self.root / "admin.json"))

    def grpc(self, *names: str) -> str:
        return ",".join(f"127.0.0.1:{self.ports[n][1]}" for n in names)

    def log(self, name: str) -> Path:
        return self.root / f"coordinator-{name}.log"

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def test_two_coordinators_survive_the_loss_of_one_and_every_acknowledged_job_finishes_once(database):
    root = shared_root()
    s3 = EmbeddedS3(root / "s3", "campugrid", secrets.token_urlsafe(24)).start()
    coords = Coordinators(root, database, s3)
    agents = Platform(root / "agents-only")  # agents only: the coordinators are subprocesses
    apis: list[Api] = []
    try:
        a = coords.start("a")
        b = coords.start("b")  # the same state folder: the same certificate, console.key
        apis += [a, b]
        pin = pins.certificate_fingerprint((root / "coord" / "tls" / "coordinator.crt").read_text())
        # Each agent knows both coordinators; one talks to a first, the other to b.
        for name, order in (("agent-1", ("a", "b")), ("agent-2", ("b", "a"))):
            agent = agents.start_agent(name, coordinator=coords.grpc(*order), pin=pin, approve=False)
            a.approve_machine(agent.machine_id())

        def submit(api: Api, i: int, retries: int = 5) -> str:
            spec = JobSpec.from_dict({**(SPEC if i < 4 else LATER), "client_job_id": f"job-{i}"})
            return str(api.submit(tar_folder(TRAIN), spec, retries=retries)["id"])

        acknowledged = [submit(a if i % 2 else b, i) for i in range(4)]
        wait_for("both agents running a job", lambda: sum(
            b.job(j)["state"] == "running" for j in acknowledged) == 2, timeout=180)

        # Submissions to a keep coming while it dies: those it answered must all run.
        stop_submitting = threading.Event()

        def keep_submitting() -> None:
            for i in range(100, 200):
                if stop_submitting.is_set():
                    return
                try:
                    acknowledged.append(submit(a, i, retries=1))
                except CampugridError:
                    return
                time.sleep(0.2)

        submitter = threading.Thread(target=keep_submitting)
        submitter.start()
        time.sleep(1.0)
        coords.procs["a"].kill()  # kill -9: the reaper's leader and agent-1's coordinator
        coords.procs["a"].wait()
        stop_submitting.set()
        submitter.join(timeout=60)
        acknowledged.append(submit(b, 300))

        stored = {j["id"] for j in b.jobs(limit=500)}
        assert set(acknowledged) <= stored
        finals = {j: b.wait(j, timeout_s=400, poll_s=0.2) for j in acknowledged}
        assert {j: f["state"] for j, f in finals.items()} == dict.fromkeys(acknowledged, "succeeded")
        for job_id, final in finals.items():
            # Once: one attempt, no lease lost to the dead coordinator, every epoch done once.
            assert final["attempt"] == 1, f"{job_id}:\n" + "\n".join(
                f"{e['at']} attempt {e['attempt']} {e['kind']}: {e['detail']}" for e in final["events"])
            assert epochs_by_attempt(b, job_id) == {1: list(range(EPOCHS))}, job_id
        ran_on = {f["machine_id"] for f in finals.values()}
        assert len(ran_on) == 2  # both agents kept working
        # b took over the lease reaper.
        assert "runs the lease reaper now" in coords.log("b").read_text()
        assert "unreachable" in (agents.agents[0].log_file or Path("/nonexistent")).read_text()
    finally:
        for api in apis:
            api.close()
        agents.stop()
        coords.stop()
        s3.stop()
        for name in ("a", "b"):
            if coords.log(name).exists():
                print(f"--- coordinator {name} ---\n" + "\n".join(
                    coords.log(name).read_text().splitlines()[-30:]))
        for agent in agents.agents:
            if agent.log_file is not None and agent.log_file.exists():
                print(f"--- {agent.name} ---\n" + "\n".join(agent.log_file.read_text().splitlines()[-30:]))
        shutil.rmtree(root, ignore_errors=True)
