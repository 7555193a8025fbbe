"""The CLI against a real coordinator (SQLite, SeaweedFS, real signatures), as a script and as
a person at a terminal sees it: --json gives one document (JSON Lines where it streams) with
the fields, the build context arrives byte for byte, progress goes to a terminal's stderr
only, and a job's output is streamed to disk. No agent: the test plays the machine through
the store, so that a job builds, runs and leaves an output on cue."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pty
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from campugrid.agent.client import CoordinatorClient, Membership
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity, pack_folder
from campugrid.coordinator import server
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.coordinator import start
from tests.support.holds import attempt

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "campugrid.cli"]
# Jobs no machine here can take (no GPU is offered), so that only the driven one is claimed.
PARKED = "resources:\n  gpus: 1\n  gpu_memory_mb: 1000\n"


@pytest.fixture(scope="module")
def coord(s3_server: EmbeddedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[server.Running]:
    root = tmp_path_factory.mktemp("cli")
    running, t = start(s3_server, root, "cli-tests")
    yield running
    running.stop()
    t.join(5)


@pytest.fixture(scope="module")
def env(coord: server.Running) -> dict[str, str]:
    """The CLI as the coordinator's admin, on a terminal that says nothing of its width."""
    return {**os.environ, "CAMPUGRID_SERVER": coord.url, "CAMPUGRID_IDENTITY": str(coord.admin_identity),
            "TERM": "xterm", "COLUMNS": "120"}


def cli(env: dict[str, str], *args: str, code: int = 0) -> str:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == code, (args, out.stdout, out.stderr)
    return out.stdout


def cli_json(env: dict[str, str], *args: str) -> object:
    out = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    assert out.stderr == "", out.stderr  # nothing human anywhere: no bars without a terminal
    return json.loads(out.stdout)  # exactly one document: json.loads refuses anything after it


def on_a_terminal(env: dict[str, str], *args: str, code: int = 0, stdout_too: bool = False,
                  shown: list[bytes] | None = None) -> tuple[str, str]:
    """Run with stderr on a pseudo-terminal (as a person's shell has it) and stdout piped,
    or on the terminal too: (stdout, what the terminal showed; `shown` has it meanwhile)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, *args], stdout=slave if stdout_too else subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    shown = [] if shown is None else shown

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child's end closed
                return
            if not data:
                return
            shown.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(10)
    os.close(master)
    terminal = b"".join(shown).decode(errors="replace")
    assert proc.returncode == code, (stdout, terminal)
    return (stdout or b"").decode(), terminal


def screen_lines(terminal: str) -> list[str]:
    """What a terminal's lines said, escape sequences aside (a redrawn line is one each time)."""
    return [line for line in re.split(r"[\r\n]+", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal))
            if line]


def context_folder(root: Path) -> Path:
    folder = root / "ctx"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\nCOPY . /app\n"
                                       "CMD [\"python3\", \"/app/train.py\"]\n")
    (folder / "data" / "blob.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (folder / "train.py").write_text("print('trained')\n")
    return folder


def stored_context(coord: server.Running, job_id: str) -> bytes:
    key = coord.coord.jobs.get(job_id).context_key
    data = coord.coord.objects.get_bytes(key)  # type: ignore[attr-defined]
    assert key == f"contexts/{hashlib.sha256(data).hexdigest()}.tar"
    return data


def test_a_yaml_spec_and_its_context_reach_the_coordinator_intact(coord, env, tmp_path):
    folder = context_folder(tmp_path)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: yaml job\ncommand: [python3, /app/train.py]\nenv:\n  MODE: fast\n" + PARKED)
    job = cli_json(env, "submit", str(folder), "--spec", str(spec))
    assert job["state"] == "queued" and job["name"] == "yaml job"
    assert job["spec"]["command"] == ["python3", "/app/train.py"]
    assert job["spec"]["resources"]["gpus"] == 1 and "MODE" in str(job["spec"]["env"])
    with tarfile.open(fileobj=io.BytesIO(stored_context(coord, job["id"]))) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert got == {str(p.relative_to(folder)): p.read_bytes()
                   for p in folder.rglob("*") if p.is_file()}
    # the SDK streams a file it is given: what is stored is that file, byte for byte
    tgz = tmp_path / "context.tar.gz"
    with open(tgz, "wb") as f:
        pack_folder(folder, f)
    with Api(coord.url, Identity.load(Path(coord.admin_identity))) as api:
        again = api.submit(tgz, JobSpec.from_dict({"name": "sdk", "resources": {
            "gpus": 1, "gpu_memory_mb": 1000}}))
    assert stored_context(coord, again["id"]) == tgz.read_bytes()


def test_progress_shows_on_a_terminal_and_stdout_stays_the_job_id(coord, env, tmp_path):
    folder = context_folder(tmp_path)
    (tmp_path / "job.yml").write_text(PARKED)
    stdout, terminal = on_a_terminal(env, "submit", str(folder), "--spec", str(tmp_path / "job.yml"))
    [job_id] = stdout.splitlines()
    assert coord.coord.jobs.get(job_id).state == JobState.QUEUED
    assert "packing" in terminal and "uploading" in terminal and "3.1 MB" in terminal, terminal
    # and with --json, on the same terminal, no bar at all
    stdout, terminal = on_a_terminal(env, "submit", str(folder), "--spec", str(tmp_path / "job.yml"),
                                     "--json")
    assert json.loads(stdout)["state"] == "queued" and terminal == ""


def test_job_commands_print_one_json_document_with_the_fields(coord, env, tmp_path):
    folder = context_folder(tmp_path)
    spec = tmp_path / "sweep.json"
    spec.write_text(json.dumps({"command": "echo", "shards": [{"payload": i} for i in range(3)],
                                "resources": {"gpus": 1, "gpu_memory_mb": 1000}}))
    job = cli_json(env, "submit", str(folder), "--spec", str(spec), "--client-id", "sweep-1")
    assert job["client_job_id"] == "sweep-1" and job["shards"]["total"] == 3
    status = cli_json(env, "status", job["id"][:8])  # as the CLI and console show ids
    assert status["id"] == job["id"] and status["events"] and status["waiting_reason"]
    assert job["id"] in [j["id"] for j in cli_json(env, "jobs", "--limit", "100")]
    logs = cli_json(env, "logs", job["id"])
    assert logs == {"job_id": job["id"], "chunks": [], "next_after": 0, "state": "queued"}
    shards = cli_json(env, "shards", job["id"])
    assert [(s["index"], s["state"]) for s in shards] == [(0, "queued"), (1, "queued"), (2, "queued")]
    assert cli_json(env, "cancel", job["id"][:6])["state"] == "cancelled"
    # the human forms still read as before
    assert cli(env, "status", job["id"]).startswith(f"job      {job['id']}  (ctx)\n"
                                                    "state    cancelled")


def test_admin_commands_and_login_print_json(coord, env, tmp_path):
    invite = cli_json(env, "apps", "invite", "carol")
    assert invite["name"] == "carol" and invite["code"] in invite["command"]
    mine = {**env, "CAMPUGRID_IDENTITY": str(tmp_path / "carol.json")}
    del mine["CAMPUGRID_SERVER"]
    login = cli_json(mine, "login", coord.url, "--invite", invite["code"])
    assert login["name"] == "carol" and login["admin"] is False
    assert Identity.load(Path(login["identity"])).app_id == login["app_id"]
    assert cli_json(mine, "jobs") == []  # carol signs with her new key, and sees her own jobs
    assert "carol" in [a["name"] for a in cli_json(env, "apps")]
    assert cli_json(env, "apps", "revoke", "carol")["revoked_at"]
    assert "campugrid agent join" in cli_json(env, "machines", "invite")["command"]
    joined = cli_json(env, "agent", "join", coord.grpc_address, "--pin", coord.certificate.fingerprint,
                      "--state-dir", str(tmp_path / "agent"), "--name", "box")
    assert joined["status"] == "pending" and joined["fingerprint"].startswith("SHA256:")
    [listed] = [m for m in cli_json(env, "machines") if m["id"] == joined["machine_id"]]
    assert (listed["online"], listed["busy"]) == (False, "")  # pending: never online
    assert "pending" in cli(env, "machines")
    approved = cli_json(env, "machines", "approve", joined["machine_id"], "--owner", "dana")
    assert (approved["status"], approved["owner"]) == ("approved", "dana")
    assert "owner dana" in cli(env, "machines")
    bad = subprocess.run([*CLI, "machines", "approve", "box", "--owner", "a\tb"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "printable" in bad.stderr, bad.stderr
    assert cli_json(env, "machines", "revoke", "box")["status"] == "revoked"


@pytest.fixture(scope="module")
def machine(coord: server.Running, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    client = CoordinatorClient(Membership.join(tmp_path_factory.mktemp("m"), coord.grpc_address,
                                               coord.certificate.fingerprint))
    client.register("driver")
    coord.coord.machines.approve(client.machine_id)
    yield client.machine_id
    client.close()


def drive(coord: server.Running, machine_id: str, client_id: str, output: bytes,
          shown: Callable[[], str], building: str, saved: str) -> threading.Thread:
    """Play the machine for the job `client_id` once it is submitted: build (with a log), run
    (with a log and a checkpoint), leave `output`, succeed; each step once the follower showed
    the last (`shown()`: what it printed so far, `building` and `saved` its words for them),
    so that it sees each phase."""
    store = coord.coord.store

    def until(words: str) -> None:  # then on regardless: the test's assertions say what is missing
        deadline = time.monotonic() + 30
        while words not in shown() and time.monotonic() < deadline:
            time.sleep(0.05)

    def run() -> None:
        deadline = time.monotonic() + 60
        while (job := store.claim_next(machine_id, 30)) is None:
            assert time.monotonic() < deadline, "the job never came"
            time.sleep(0.1)
        assert job.client_job_id == client_id
        store.append_logs(attempt(job.id, job.attempt, machine_id), "build", 0, "STEP 1/2: FROM python\n")
        until(building)
        store.renew_lease(attempt(job.id, job.attempt, machine_id), JobState.RUNNING, 30)
        store.append_logs(attempt(job.id, job.attempt, machine_id), "run", 0, "epoch 1 loss 0.5\n")
        store.checkpoints.record(attempt(job.id, job.attempt, machine_id), epoch=1,
                                key=f"checkpoints/{job.id}/1", size=3 * 1024 * 1024,
                                sha256="0" * 64, keep=3)
        until(saved)  # the follower looks at the job's events every 2 s
        key = f"outputs/{job.id}.tar.gz"
        coord.coord.objects.put_bytes(key, output)
        store.finish(attempt(job.id, job.attempt, machine_id), succeeded=True, exit_code=0, reason=None,
                     result="0.5", output_key=key, limits={})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_submit_wait_streams_json_lines_and_the_output_downloads(coord, env, machine, tmp_path):
    folder = context_folder(tmp_path)
    output = os.urandom(5 * 1024 * 1024)
    printed: list[str] = []
    driver = drive(coord, machine, "waited-1", output, lambda: "".join(printed),
                   building="STEP 1/2: FROM python", saved=f"epoch 1, {3 * 1024 * 1024} bytes")
    with subprocess.Popen([*CLI, "submit", str(folder), "--client-id", "waited-1", "--wait",
                           "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        timer = threading.Timer(120, proc.kill)
        timer.start()
        assert proc.stdout is not None and proc.stderr is not None
        printed.extend(proc.stdout)  # line by line, as the follower prints them
        stderr = proc.stderr.read()
        timer.cancel()
    driver.join(10)
    assert proc.returncode == 0 and stderr == "", (printed, stderr)
    lines = [json.loads(line) for line in printed]
    assert lines[0]["event"] == "submitted" and lines[0]["job"]["client_job_id"] == "waited-1"
    job_id = lines[0]["job"]["id"]
    states = [x["state"] for x in lines if x["event"] == "state"]
    assert states[0] in ("queued", "building") and states[-1] == "succeeded", states
    assert "running" in states
    logs = [(x["stream"], x["text"]) for x in lines if x["event"] == "log"]
    assert logs == [("build", "STEP 1/2: FROM python\n"), ("run", "epoch 1 loss 0.5\n")]
    assert lines[-1]["event"] == "final" and lines[-1]["job"]["state"] == "succeeded"
    assert lines[-1]["job"]["result"] == "0.5" and lines[-1]["job"]["id"] == job_id
    saved = [x for x in lines if x["event"] == "job" and x["kind"] == "checkpoint"]
    assert [x["detail"] for x in saved] == [f"epoch 1, {3 * 1024 * 1024} bytes"], lines

    got = cli_json(env, "output", job_id, "-o", str(tmp_path / "out.tar.gz"))
    assert got == {"job_id": job_id, "path": str(tmp_path / "out.tar.gz"), "size": len(output),
                   "sha256": hashlib.sha256(output).hexdigest()}
    assert (tmp_path / "out.tar.gz").read_bytes() == output
    stdout, terminal = on_a_terminal(env, "output", job_id, "-o", str(tmp_path / "again.tgz"))
    assert stdout == f"{tmp_path / 'again.tgz'}\n" and "downloading" in terminal
    assert "5.2/5.2 MB" in terminal, terminal


def test_submit_wait_shows_the_phase_on_a_terminal(coord, env, machine, tmp_path):
    folder = context_folder(tmp_path)
    live: list[bytes] = []  # what the terminal shows, as it shows it

    def driving(client_id: str) -> threading.Thread:
        live.clear()
        return drive(coord, machine, client_id, b"out", lambda: b"".join(live).decode(
            errors="replace"), building="building its image", saved="checkpoint epoch 1 saved")

    driver = driving("waited-2")
    stdout, terminal = on_a_terminal(env, "submit", str(folder), "--client-id", "waited-2", "--wait",
                                     shown=live)
    driver.join(10)
    lines = stdout.splitlines()
    assert lines[1:3] == ["build| STEP 1/2: FROM python", "epoch 1 loss 0.5"], stdout
    assert lines[3] == f"job      {lines[0]}  (ctx)" and lines[4].startswith("state    succeeded")
    assert "building its image" in terminal and ": running" in terminal, terminal
    assert "checkpoint epoch 1 saved (3.0 MB)" in terminal, terminal
    assert "STEP 1/2" not in terminal  # the logs went to stdout, and only there
    # stdout on the same terminal: each log line is a line of its own above the spinner
    driver = driving("waited-3")
    _, terminal = on_a_terminal(env, "submit", str(folder), "--client-id", "waited-3", "--wait",
                                stdout_too=True, shown=live)
    driver.join(10)
    shown = screen_lines(terminal)
    assert "build| STEP 1/2: FROM python" in shown and "epoch 1 loss 0.5" in shown, shown
    assert any(line.endswith("building its image") for line in shown), shown


def test_the_coordinator_checks_and_stores_a_large_context_without_holding_it(coord, tmp_path):
    """Client and coordinator share this process: the peak of all Python allocations while a
    48 MiB context is signed, sent, checked, digested and stored stays a fraction of it."""
    import tracemalloc

    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\nCMD [\"true\"]\n")
    (folder / "weights.bin").write_bytes(os.urandom(48 * 1024 * 1024))
    tgz = tmp_path / "big.tar.gz"
    with open(tgz, "wb") as f:
        pack_folder(folder, f)
    with Api(coord.url, Identity.load(Path(coord.admin_identity))) as api:
        tracemalloc.start()
        try:
            job = api.submit(tgz, JobSpec.from_dict({"name": "big", "resources": {
                "gpus": 1, "gpu_memory_mb": 1000}}))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 24 * 1024 * 1024, peak  # the old read of the whole upload peaked above 48 MiB
    assert stored_context(coord, job["id"]) == tgz.read_bytes()


def test_ctrl_c_during_submit_wait_says_the_job_goes_on_and_how_to_follow_or_cancel_it(
        coord, env, tmp_path):
    import signal

    folder = context_folder(tmp_path)
    # As from a terminal: Ctrl-C's SIGINT is not ignored (as it is where the tests run in a
    # shell's background), whatever this process was given.
    with subprocess.Popen([*CLI, "submit", str(folder), "--wait", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                     signal.SIG_DFL)) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        submitted = json.loads(proc.stdout.readline())  # it is queued: nobody takes it here
        job_id = submitted["job"]["id"]
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    short = job_id[:8]
    assert (f"stopped following job {short}; it goes on. Follow it again with `campugrid logs "
            f"{short} --follow`, or stop it with `campugrid cancel {short}`") in stderr, stderr
    assert "Traceback" not in stderr
    assert cli_json(env, "status", short)["state"] == "queued"
    cli_json(env, "cancel", short)


def test_submit_takes_the_common_flags_the_folders_own_spec_and_another_dockerfile(
        coord, env, tmp_path):
    folder = context_folder(tmp_path)
    (folder / "job.yaml").write_text("env:\n  MODE: fast\n" + PARKED)  # picked up unasked
    (folder / "docker").mkdir()
    (folder / "docker" / "train.Dockerfile").write_text(
        'FROM localhost/campugrid/python:bookworm\nCOPY train.py /t.py\nCMD ["python3", "/t.py"]\n')
    (folder / ".dockerignore").write_text("data/\n")
    job = cli_json(env, "submit", str(folder), "--cpus", "2", "--memory", "4G", "-e", "SEED=7",
                   "--env", "LR=3e-4", "-f", str(folder / "docker" / "train.Dockerfile"))
    assert job["name"] == "ctx"  # the folder's name
    res = job["spec"]["resources"]
    assert (res["cpus"], res["memory_mb"], res["gpus"]) == (2, 4096, 1)  # flags over job.yaml
    assert sorted(job["spec"]["env"]) == ["LR", "MODE", "SEED"]  # values are not shown back
    stored = coord.coord.jobs.get(job["id"]).spec.env
    assert dict(stored) == {"MODE": "fast", "SEED": "7", "LR": "3e-4"}
    with tarfile.open(fileobj=io.BytesIO(stored_context(coord, job["id"]))) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert got["Dockerfile"] == (folder / "docker" / "train.Dockerfile").read_bytes()
    assert not any(n.startswith("data/") for n in got)  # .dockerignore
    cli(env, "submit", str(folder), "--memory", "lots", code=2)
    cli(env, "submit", str(folder), "--env", "NOVALUE", code=2)
    gpu = cli_json(env, "submit", str(folder), "--gpus", "2", "--gpu-memory", "12G")
    assert (gpu["spec"]["resources"]["gpus"], gpu["spec"]["resources"]["gpu_memory_mb"]) == (
        2, 12 * 1024)
