"""Sharded jobs end to end, for real: one task per shard, run in one warm gVisor sandbox per
agent, results collected per shard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from campugrid.cli.platform import ProviderUser
from campugrid.client import tar_folder
from campugrid.protocol.errors import NotFound
from campugrid.protocol.spec import JobSpec
from tests.support import hostile

pytestmark = pytest.mark.acceptance
REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "examples" / "sweep"

# process mode: the last stdout line is the result, or result.json when the shard writes one;
# /tmp is the sandbox's, so a counter there shows whether shards share a sandbox.
PROCESS_JOB = r"""
import json, os, sys
payload = json.loads(sys.stdin.read())
assert payload == json.loads(os.environ["CAMPUGRID_SHARD_PAYLOAD"])
seen = len(os.listdir("/tmp/counter")) if os.path.isdir("/tmp/counter") else 0
os.makedirs("/tmp/counter", exist_ok=True)
open(f"/tmp/counter/{os.environ['CAMPUGRID_SHARD_INDEX']}", "w").close()
print("working on", payload)
if payload.get("fail"):
    sys.exit(3)
if payload.get("file"):
    with open(os.path.join(os.environ["CAMPUGRID_SHARD_OUTPUT"], "result.json"), "w") as f:
        json.dump({"from": "file", "n": payload["n"]}, f)
    print("not the result")
else:
    wrote = []
    for folder in ("/output", "/checkpoints", "/"):
        try:
            open(os.path.join(folder, "x"), "w").close()
            wrote.append(folder)
        except OSError:
            pass
    print(json.dumps({"square": payload["n"] ** 2, "earlier_in_this_sandbox": seen,
                      "wrote_outside_tmp": wrote}))
"""


def run_log_until(api, job_id: str, text: str, timeout_s: float = 30) -> str:
    """The run log once `text` is in it (the last lines may land after the job's end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = "".join(c["text"] for c in api.logs(job_id)["chunks"] if c["stream"] == "run")
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.3)


def test_a_sweep_runs_every_shard_in_one_warm_sandbox(api, platform):
    spec = JobSpec.from_json((SWEEP / "job.json").read_text())
    # through the README's commands: submit --wait, then the shards' results
    cli = [sys.executable, "-m", "campugrid.cli"]
    out = subprocess.run([*cli, "submit", str(SWEEP), "--spec", str(SWEEP / "job.json"), "--wait",
                          "--server", platform.url], capture_output=True, env=platform.cli_env(), text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    job = {"id": out.stdout.splitlines()[0].strip()}
    n = len(spec.shards)
    assert f"({n} shards: 0 queued, 0 running, {n} succeeded, 0 failed)" in out.stdout
    listed = subprocess.run([*cli, "shards", job["id"], "--server", platform.url],
                            capture_output=True, env=platform.cli_env(), text=True, timeout=60)
    assert [json.loads(line)["state"] for line in listed.stdout.splitlines()] == ["succeeded"] * n
    final = api.job(job["id"])
    assert final["state"] == "succeeded", final
    assert final["result"] == f"{len(spec.shards)} of {len(spec.shards)} shards succeeded"
    shards = list(api.shards(job["id"]))
    assert [s["index"] for s in shards] == list(range(len(spec.shards)))
    for s, sent in zip(shards, spec.shards, strict=True):
        assert s["state"] == "succeeded" and s["result"]["lr"] == sent.payload["lr"]
        assert s["result"]["epochs"] == sent.payload["epochs"]
    # Served by one process in one sandbox: the data was made once, not once per shard.
    assert len({(s["result"]["sandbox"], s["result"]["pid"]) for s in shards}) == 1
    # Heavy first on the only (hence fastest) machine: the 400-epoch shards went first.
    losses = {(s["result"]["lr"], s["result"]["epochs"]): s["result"]["loss"] for s in shards}
    assert losses[(1.0, 400)] < losses[(0.01, 50)]
    events = [e["kind"] for e in api.job(job["id"])["events"]]
    assert events.count("session") == 1 and events[-1] == "succeeded"


def test_process_mode_results_failures_and_reuse(api, platform, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    "COPY job.py /job.py\n")
    (ctx / "job.py").write_text(PROCESS_JOB)
    payloads = [{"n": 1}, {"n": 2}, {"n": 3, "fail": True}, {"n": 4, "file": True}, {"n": 5}]
    spec = JobSpec.from_dict({"command": ["python3", "/job.py"],
                              "shards": [{"payload": p} for p in payloads]})
    job = api.submit(tar_folder(ctx), spec)
    final = api.wait(job["id"], timeout_s=300, poll_s=0.2, check=False)
    assert final["state"] == "failed", final
    assert "1 of 5 shards failed (first: shard 2: the command exited with status 3)" in final["reason"]
    shards = {s["index"]: s for s in api.shards(job["id"])}
    assert shards[2]["state"] == "failed" and shards[2]["exit_code"] == 3
    assert shards[3]["result"] == {"from": "file", "n": 4}
    ok = [shards[i] for i in (0, 1, 4)]
    assert [s["result"]["square"] for s in ok] == [1, 4, 25]
    assert all(s["result"]["wrote_outside_tmp"] == [] for s in ok)  # no host folder is writable
    # One sandbox for all five, one after another: each shard saw the marks of those run
    # before it in /tmp (a fresh sandbox per shard would show 0 every time).
    seen = sorted(s["result"]["earlier_in_this_sandbox"] for s in ok)
    assert len(set(seen)) == 3 and seen[-1] >= 2, seen
    assert [s["index"] for s in api.shards(job["id"], state="failed")] == [2]
    run_log = run_log_until(api, job["id"], "5 shards run in one sandbox")
    assert "[shard 0] working on {'n': 1}" in run_log


def test_an_image_without_python_fails_the_job_with_a_reason(api, platform, tmp_path):
    ctx = tmp_path / "nopython"
    ctx.mkdir()
    shutil.copy(SWEEP / "Dockerfile", ctx / "Dockerfile")
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    "RUN rm -f /usr/bin/python3 /usr/bin/python3.*\n")
    spec = JobSpec.from_dict({"command": ["true"], "shards": [{"payload": 1}, {"payload": 2}]})
    final = api.wait(api.submit(tar_folder(ctx), spec)["id"], timeout_s=300, poll_s=0.2, check=False)
    assert final["state"] == "failed"
    assert "sharded jobs need python3 in the image" in final["reason"]
    assert {s["state"] for s in api.shards(final["id"])} == {"cancelled"}


def test_bad_shard_lists_are_refused_and_store_nothing(api, platform):
    before = len(api.jobs(limit=1000))
    ctx = tar_folder(SWEEP)
    for raw, why in (
        ({"shards": [{"payload": 1}]}, "a sharded job needs a command"),
        ({"command": ["x"], "shards": [{"cost": 1}]}, "must be an object with a payload"),
        ({"command": ["x"], "shards": [{"payload": 1, "cost": -1}]}, "shards[0].cost"),
        ({"command": ["x"], "shards": []}, "must be a list of 1 to"),
        ({"command": ["x"], "shards": [{"payload": 1}], "shard_mode": "fast"}, "shard_mode"),
    ):
        resp = api.http.post("/v1/jobs", files={"context": ("c.tar.gz", ctx)},
                             data={"spec": json.dumps(raw)})
        assert resp.status_code == 422 and why in resp.json()["detail"], (raw, resp.text)
    assert len(api.jobs(limit=1000)) == before
    with pytest.raises(NotFound, match="no job"):
        list(api.shards("00000000-0000-0000-0000-000000000000"))


HOG = r"""
import json, os
payload = json.loads(os.environ["CAMPUGRID_SHARD_PAYLOAD"])
if payload == "hog":
    b = bytearray(700 * 1024 * 1024)
    b[::4096] = b"x" * len(b[::4096])
print(json.dumps({"ok": payload}))
"""


@pytest.mark.skipif(not hostile.delegated(ProviderUser.resolve(), "memory").is_dir(),
                    reason="no delegated memory cgroup on this host: infra/setup.sh makes one "
                           "(cgroup v1); without it memory limits are not enforced")
def test_a_shard_that_kills_its_sandbox_fails_alone_and_the_rest_run_in_a_new_one(api, tmp_path):
    ctx = tmp_path / "hog"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    "COPY hog.py /hog.py\n")
    (ctx / "hog.py").write_text(HOG)
    spec = JobSpec.from_dict({"command": ["python3", "/hog.py"],
                              "resources": {"memory_mb": 256},
                              "shards": [{"payload": 1}, {"payload": "hog"}, {"payload": 3}]})
    job = api.submit(tar_folder(ctx), spec)
    final = api.wait(job["id"], timeout_s=300, poll_s=0.2, check=False)
    assert final["state"] == "failed", final
    assert "first: shard 1: the sandbox stopped during this shard (out of memory?" in final["reason"]
    shards = {s["index"]: s for s in api.shards(job["id"])}
    assert shards[1]["state"] == "failed" and shards[1]["tries"] == 0  # the job's fault: final
    assert (shards[0]["result"], shards[2]["result"]) == ({"ok": 1}, {"ok": 3})
    assert "3 shards run in 2 sandboxes" in run_log_until(api, job["id"], "in 2 sandboxes")
