"""End to end, for real: REST submit -> agent (unprivileged) -> buildah RUN under runsc ->
podman+runsc run -> result, logs and output back through the coordinator."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pwd
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from campugrid.agent.install import scope_of
from campugrid.agent.task import job_image_prefix
from campugrid.cli.platform import ProviderUser
from campugrid.client import tar_folder
from campugrid.protocol.spec import JobSpec
from tests.support.hostile import provider_uids
from tests.support.runtimes import gvisor_kernel
from tests.support.timing import BUILT, READY

pytestmark = pytest.mark.acceptance
REPO = Path(__file__).resolve().parents[2]
HELLO = REPO / "examples" / "hello"


def sandbox_uids(stop: threading.Event, seen: list[int]) -> None:
    """Host uids of every runsc sandbox process seen until `stop`."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if b"runsc" in cmd and b"boot" in cmd:
                seen.append(int(next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1]))
        time.sleep(0.05)


def test_the_sample_job_builds_and_runs_in_gvisor_offline_unprivileged(api, platform):
    stop, uids = threading.Event(), []
    watcher = threading.Thread(target=sandbox_uids, args=(stop, uids))
    watcher.start()
    try:
        # The sample's own CMD, then a pause so the host side of the sandbox can be observed.
        spec = JobSpec.from_dict({"command": ["sh", "-c", "sleep 3; python3 /app/hello.py"],
                                  "env": {"PROBE_PORT": str(platform.http_port)}})
        job = api.submit(tar_folder(HELLO), spec)
        final = api.wait(job["id"], timeout_s=240, poll_s=0.2)
    finally:
        stop.set()
        watcher.join()
    assert final["state"] == "succeeded", final
    result = json.loads(final["result"])
    assert gvisor_kernel(result["build"]["kernel"]), result
    assert "Starting gVisor" in result["build"]["dmesg_first"]
    assert gvisor_kernel(result["run"]["kernel"]) and "Starting gVisor" in result["run"]["dmesg_first"]
    assert result["build"]["squares"] == 338350 and result["primes_below_1000"] == 168
    assert result["network"]["interfaces"] == ["lo"]
    assert result["network"][f"reached_127.0.0.1:{platform.http_port}"] is False
    provider = ProviderUser.resolve()
    # Inside, the job is the root of rootless Podman's user namespace, without a capability:
    # on the host, that is the provider's own uid (the files it wrote to /output are theirs).
    assert (result["uid_inside"], result["capabilities"]) == (0, 0), result
    # Every sandbox on the host (the other test worker's user has its own) runs as a user that
    # lends the machine or one of its subordinate ids, never as root; this job's among them.
    assert set(uids) & provider_uids(provider), f"no sandbox of {provider.name} seen: {uids}"
    subordinate = {line.split(":")[0] for line in Path("/etc/subuid").read_text().splitlines()}
    lenders = [ProviderUser(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))
               for pw in pwd.getpwall() if pw.pw_name in subordinate]  # who runs containers
    assert 0 not in uids and set(uids) <= set().union(*map(provider_uids, lenders)), set(uids)
    # logs: the build's steps and the job's lines, each in its stream
    chunks = api.logs(job["id"])["chunks"]
    build = "".join(c["text"] for c in chunks if c["stream"] == "build")
    run = "".join(c["text"] for c in chunks if c["stream"] == "run")
    assert "RUN python3 /app/hello.py --build" in build
    assert f"job ran on kernel {result['run']['kernel']}" in run
    # where the time went, as the build log's last lines say (bench/builds.py reads them)
    ready, built = READY.search(build), BUILT.search(build)
    assert ready and built, build[-2000:]
    total, *parts = map(float, ready.groups())
    assert abs(sum(parts) - total) <= 0.25 and parts[-1] >= sum(map(float, built.groups())) - 0.25
    assert build.index(built.group(0)) < build.index(ready.group(0))
    # the /output folder, as a tarball
    with tarfile.open(fileobj=io.BytesIO(api.output(job["id"]))) as tar:
        assert json.load(tar.extractfile("result.json"))["message"] == "hello from campugrid"
        # listed on the job as its agent packed it
        assert final["output_files"] == [[m.name, m.size] for m in tar.getmembers()]
    assert all(v == "enforced" or v.startswith("not enforced: ") for v in final["limits"].values())
    # A plain success's history: no call was refused (no renewal after the attempt ended).
    assert "refused" not in [e["kind"] for e in api.job(job["id"])["events"]], final["events"]
    assert "Copying blob" not in build


def test_the_cli_shows_the_job(api, platform):
    job = api.submit(tar_folder(HELLO), JobSpec(name="cli check"))
    api.wait(job["id"], timeout_s=240, poll_s=0.2, check=False)
    cli = [sys.executable, "-m", "campugrid.cli"]
    out = subprocess.run([*cli, "status", job["id"], "--server", platform.url],
                         capture_output=True, env=platform.cli_env(), text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "succeeded" in out.stdout and "cli check" in out.stdout
    logs = subprocess.run([*cli, "logs", job["id"], "--server", platform.url],
                          capture_output=True, env=platform.cli_env(), text=True, timeout=60)
    assert "build| STEP" in logs.stdout and "hello from campugrid" in logs.stdout
    listed = subprocess.run([*cli, "jobs", "--server", platform.url], capture_output=True, env=platform.cli_env(),
                            text=True, timeout=60)
    assert job["id"] in listed.stdout
    missing = subprocess.run([*cli, "status", "not-a-job", "--server", platform.url],
                             capture_output=True, env=platform.cli_env(), text=True, timeout=60)
    assert missing.returncode == 2 and "no job 'not-a-job'" in missing.stderr


def test_a_failed_build_fails_the_job_with_the_build_log_tail(api, tmp_path):
    (tmp_path / "Dockerfile").write_text(
        "FROM localhost/campugrid/python:bookworm\nRUN echo preparing-step-91c && exit 4\n"
        'CMD ["true"]\n')
    job = api.submit(tar_folder(tmp_path), JobSpec())
    final = api.wait(job["id"], timeout_s=240, poll_s=0.2, check=False)
    assert final["state"] == "failed"
    assert final["reason"].startswith("build failed")
    assert "preparing-step-91c" in final["reason"]


def test_a_failing_command_gives_its_exit_status(api):
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": "echo partial; exit 7"}))
    final = api.wait(job["id"], timeout_s=240, poll_s=0.2, check=False)
    assert final["state"] == "failed" and final["exit_code"] == 7
    assert final["reason"] == "the job's command exited with status 7"
    assert final["result"] == "partial"


def test_cancelling_a_running_job_removes_its_sandbox(api, platform):
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": ["sleep", "600"]}))
    deadline = time.monotonic() + 120
    while api.job(job["id"])["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    provider = ProviderUser.resolve()

    def containers() -> str:
        return subprocess.run(provider.command(["podman", "ps", "-a", "--format", "{{.Names}}"]),
                              capture_output=True, text=True, timeout=60).stdout

    deadline = time.monotonic() + 30
    while job["id"] not in containers():
        assert time.monotonic() < deadline, "the job's container never appeared"
        time.sleep(0.2)
    # A busy machine is online, says what it is busy with, and keeps telling the coordinator
    # it is alive (a heartbeat at least every 10 s, not only between tasks).
    [machine] = api.machines()
    assert (machine["online"], machine["busy"]) == (True, job["id"][:8])
    behind = api.submit(tar_folder(HELLO), JobSpec())
    assert api.job(behind["id"])["waiting_reason"] == (
        f"waiting for the one machine that fits (acceptance-agent): busy with job {job['id'][:8]}")
    seen = machine["last_seen_at"]
    deadline = time.monotonic() + 15
    while api.machines()[0]["last_seen_at"] == seen:
        assert time.monotonic() < deadline, "no heartbeat while the machine was busy"
        time.sleep(0.5)
    assert api.job(job["id"])["state"] == "running"
    api.cancel(behind["id"])
    assert api.cancel(job["id"])["state"] == "cancelled"
    deadline = time.monotonic() + 3 * platform.lease_seconds + 15
    while job["id"] in containers():
        assert time.monotonic() < deadline, "the sandbox outlived its cancelled job"
        time.sleep(0.3)
    assert api.job(job["id"])["state"] == "cancelled"


def test_a_dataset_is_mounted_read_only(api, platform):
    assert platform.s3 is not None
    from campugrid.coordinator.objects import S3Store

    store = S3Store(platform.s3.endpoint, platform.s3.access_key, platform.s3.secret_key, "datasets")
    store.ensure_bucket()
    store.put_bytes("iris/part-0.csv", b"5.1,3.5\n4.9,3.0\n")
    store.put_bytes("iris/meta/info.txt", b"two rows")
    store.close()
    reader = ("import os; rows = open('/data/iris/part-0.csv').read().split();"
              "info = open('/data/iris/meta/info.txt').read();"
              "w = os.access('/data/iris/part-0.csv', os.W_OK);"
              "print(len(rows), info, 'writable' if w else 'read-only')")
    sha = {path: hashlib.sha256(data).hexdigest()
           for path, data in (("part-0.csv", b"5.1,3.5\n4.9,3.0\n"), ("meta/info.txt", b"two rows"))}
    spec = JobSpec.from_dict({"command": ["python3", "-c", reader],
                              "datasets": [{"name": "iris", "uri": "s3://datasets/iris/",
                                            "sha256": sha}]})
    final = api.wait(api.submit(tar_folder(HELLO), spec)["id"], timeout_s=240, poll_s=0.2)
    assert final["state"] == "succeeded", final
    assert final["result"] == "2 two rows read-only"


def test_links_a_job_plants_never_make_the_agent_read_host_files(api, platform):
    """/output and /checkpoints are host folders the job writes: links it puts there must not
    make the agent upload host files (its credentials, /etc/shadow...)."""
    job_code = (
        "import os\n"
        "from campugrid import hooks\n"
        "open('/output/real.txt', 'w').write('mine')\n"
        "os.symlink('/etc', '/output/etc-dir')\n"
        "os.symlink('/etc/shadow', '/output/shadow')\n"
        "with hooks.save(2) as f:\n"
        "    (f / 'w').write_text('weights')\n"
        "os.symlink('/etc/shadow', '/checkpoints/epoch-00000002/leak')\n"
        "os.symlink('/etc', '/checkpoints/epoch-00000003')\n"
        "import time; time.sleep(3)\n"
        "print('planted')\n")
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": ["python3", "-c", job_code]}))
    final = api.wait(job["id"], timeout_s=240, poll_s=0.2)
    assert final["state"] == "succeeded" and final["result"] == "planted", final
    with tarfile.open(fileobj=io.BytesIO(api.output(job["id"]))) as tar:
        assert tar.getnames() == ["real.txt"]
    store = platform.running.coord.store
    recorded = store.checkpoints.of(job["id"])
    assert [c.epoch for c in recorded] == [2]
    blob = platform.running.coord.objects.get_bytes(recorded[0].key)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert sorted(tar.getnames()) == ["MANIFEST.json", "w"]


def test_a_gpu_job_on_a_cpu_only_platform_waits_and_says_why(api, platform):
    spec = JobSpec.from_dict({"resources": {"gpus": 1, "gpu_memory_mb": 8192}})
    fleet = platform.running.service.fleet
    deadline = time.monotonic() + 60
    while not list(fleet.idle()):
        assert time.monotonic() < deadline, "the agent never waited for work on its stream"
        time.sleep(0.1)
    rounds = fleet.rounds
    job = api.submit(tar_folder(HELLO), spec)
    # The coordinator offers work to the agent waiting on its stream twice more: when the job
    # came, and on a look of its own a few seconds later; both claims pass the job over.
    deadline = time.monotonic() + 60
    while fleet.rounds < rounds + 2:
        assert time.monotonic() < deadline, "the coordinator stopped offering the agent work"
        assert list(fleet.idle()), "the agent is no longer waiting for work"
        time.sleep(0.1)
    seen = api.job(job["id"])
    assert seen["state"] == "queued"
    assert seen["waiting_reason"] == "no online machine has a GPU (1 CPU-only online)"
    out = subprocess.run([sys.executable, "-m", "campugrid.cli", "status", job["id"], "--server",
                          platform.url], capture_output=True, env=platform.cli_env(), text=True, timeout=60)
    assert "waiting  no online machine has a GPU" in out.stdout
    api.cancel(job["id"])


def test_writing_past_the_output_limit_stops_the_job(api):
    spec = JobSpec.from_dict({"command": ["sh", "-c", "dd if=/dev/zero of=/output/big bs=1M count=64; sleep 30"],
                              "resources": {"output_mb": 8}})
    final = api.wait(api.submit(tar_folder(HELLO), spec)["id"], timeout_s=240, poll_s=0.2, check=False)
    assert final["state"] == "failed"
    assert "wrote more than 8 MB to /output and /checkpoints" in final["reason"]


def test_a_file_sent_with_the_job_is_mounted_read_only_and_deleted_after(api, platform, tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\x00\x01 only on this laptop")
    reader = ("import os; b = open('/data/w/weights.bin', 'rb').read();"
              "print(len(b), 'read-only' if not os.access('/data/w/weights.bin', os.W_OK) else 'rw')")
    out = subprocess.run([sys.executable, "-m", "campugrid.cli", "submit", str(HELLO), "--command",
                          f"python3 -c \"{reader}\"", "--upload", f"w={data}", "--wait"],
                         capture_output=True, env=platform.cli_env(), text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    job = api.job(out.stdout.splitlines()[0].strip())
    assert job["result"] == "22 read-only"
    [ticket] = [d["ticket"] for d in job["spec"]["datasets"]]
    assert ("inputs", "w: 1 file by upload ticket, 22 bytes, checked by sha256") in [
        (e["kind"], e["detail"]) for e in job["events"]]
    assert platform.running is not None
    objects = platform.running.coord.objects
    deadline = time.monotonic() + 60  # the reaper deletes it once the job has ended
    while objects.exists(f"uploads/{ticket}"):
        assert time.monotonic() < deadline, "the upload outlived its job"
        time.sleep(0.5)


def test_the_sdk_snippet_in_the_docs_runs_as_printed(platform, tmp_path):
    """docs/using.md's Python example, pasted into a file and run next to a folder
    `mytrain`: it prints the job's result; a failing job raises JobFailed."""
    text = (Path(__file__).parents[2] / "docs" / "using.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'api.submit(Path("mytrain")' in snippet
    (tmp_path / "mytrain").mkdir()
    (tmp_path / "mytrain" / "Dockerfile").write_text(
        "FROM localhost/campugrid/python:bookworm\nCOPY . /app\nWORKDIR /app\n")
    (tmp_path / "mytrain" / "train.py").write_text("import os\nprint('loss 0.1', "
                                                   "os.path.exists('/app/big.bin'))\n")
    (tmp_path / "mytrain" / "big.bin").write_bytes(b"\0" * 1024)
    (tmp_path / "mytrain" / ".dockerignore").write_text("*.bin\n")
    (tmp_path / "snippet.py").write_text(snippet)
    env = {**platform.cli_env(), "CAMPUGRID_SERVER": ""}
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, "loss 0.1 False\n"), out.stderr[-2000:]
    (tmp_path / "mytrain" / "train.py").write_text("raise SystemExit(3)\n")
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "JobFailed: job " in out.stderr, out.stderr[-2000:]
    assert "failed: the job's command exited with status 3" in out.stderr, out.stderr[-2000:]


def test_a_job_starts_from_its_image_as_stored_and_the_image_goes_with_its_task(api, platform):
    """A sandbox starts from its image as the store holds it: Podman writes no ID-mapped copy
    of it (with `--userns keep-id` it wrote one of the whole image at the image's first start:
    2 s for this one, 12 s for the 6 GB frameworks image with its files cached, as much disk
    again). The image goes as its task ends."""
    provider = ProviderUser.resolve()
    graph = subprocess.run(provider.command(["podman", "info", "--format",
                                             "{{.Store.GraphRoot}}"]),
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    prefix = job_image_prefix(scope_of(platform.agents[0].state_dir))

    def job_images() -> dict[str, tuple[str, list[str]]]:
        """This agent's job images: name -> (image ID, its ID-mapped layers)."""
        records = json.loads((Path(graph) / "overlay-images" / "images.json").read_text())
        return {name: (r["id"], r.get("mapped-layers") or []) for r in records
                for name in r.get("names") or [] if name.startswith(prefix)}

    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": ["sleep", "3"]}))
    seen: list[tuple[str, list[str]]] = []  # its image's records while it runs
    deadline = time.monotonic() + 240
    while (state := api.job(job["id"])["state"]) in ("queued", "building", "running"):
        assert time.monotonic() < deadline, state
        if state == "running":
            seen += [v for k, v in job_images().items() if k.startswith(prefix + job["id"])]
        time.sleep(0.1)
    assert state == "succeeded", api.job(job["id"])
    assert seen and all(copies == [] for _, copies in seen), seen  # started without a copy
    deadline = time.monotonic() + 30
    while job_images():
        assert time.monotonic() < deadline, f"job images left after the task: {job_images()}"
        time.sleep(0.2)
