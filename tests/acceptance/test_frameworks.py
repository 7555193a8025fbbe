"""Checkpoints of training code that never heard of campugrid, through the platform: a Hugging
Face Trainer script (tests/frameworks, unchanged, in the frameworks image that
infra/frameworks-image.sh makes), run by real agents under gVisor. The agent holding
the job is killed with SIGKILL after its checkpoints are recorded; the job finishes on the other
agent from the newest one, with the weights of a run never stopped. The hooks against all four
frameworks, drains included, run on the host in tests/integration/test_framework_hooks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.platform import BASE_IMAGE, Platform
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.acceptance.test_resilience import checkpoints_of, holder, platform_with, wait_for
from tests.integration.test_framework_hooks import SCRIPTS, SITE
from tests.support.console import CLI

pytestmark = pytest.mark.acceptance
IMAGE = "localhost/campugrid/frameworks:v1"
JOBS = {
    # The Trainer's own checkpoint-<step> folders, taken by its hook as it saves them; the spec
    # names its output_dir only to have it writable (the image's root is read-only). (The
    # plain loop, whose folder the spec names for the watch, Lightning and Keras run on the
    # host: each case here is ~45 s of the suite's 25 minutes.)
    "transformers": {"command": ["python3", "train_hf.py"],
                     "checkpoints": {"dir": "/app/outputs"}},
}
ENV = {"OMP_NUM_THREADS": "1"}  # the same arithmetic in the sandbox as on the host


@pytest.fixture(scope="module")
def grid() -> Iterator[tuple[Platform, Api]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAMPUGRID_ALLOWED_BASES", f"{BASE_IMAGE},{IMAGE}")
        with platform_with({"agent-a": (), "agent-b": ()}) as running:
            yield running


def never_stopped(script: str, tmp_path: Path) -> str:
    """The weights of an uninterrupted run, on the host (the same packages as the image)."""
    done = subprocess.run(["/usr/bin/python3", str(SCRIPTS / script)], cwd=tmp_path,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                               "PYTHONPATH": str(SITE), **ENV},
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["weights"]


@pytest.mark.parametrize("framework", list(JOBS))
def test_an_unchanged_script_killed_midway_finishes_elsewhere_from_its_checkpoint(
        grid, tmp_path, framework):
    p, api = grid
    spec = JobSpec.from_dict({**JOBS[framework], "env": {**ENV, "STEP_SECONDS": "0.25"},
                              "resources": {"memory_mb": 2048}})
    job = api.submit(tar_folder(SCRIPTS), spec)["id"]
    expected = never_stopped(str(spec.command[1]), tmp_path)  # meanwhile
    try:
        wait_for("two checkpoints recorded", lambda: len(checkpoints_of(api, job)) >= 2,
                 timeout=240)
    except AssertionError:
        said = api.job(job)
        logs = "".join(c["text"] for c in api.logs(job)["chunks"])
        raise AssertionError(f"{said['state']} {said.get('reason')}\n{logs[-4000:]}") from None
    victim = holder(p, api, job)
    os.kill(victim.pid(), signal.SIGKILL)
    before = checkpoints_of(api, job)
    final = api.wait(job, timeout_s=300, poll_s=0.3)
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 2 and final["machine_id"] != victim.machine_id()
    assert json.loads(final["result"])["weights"] == expected
    logs = "".join(c["text"] for c in api.logs(job)["chunks"] if c["attempt"] == 2)
    resumed = before[-1]
    assert f"resuming from the checkpoint of epoch {resumed}" in logs, logs[-3000:]
    assert f"put the checkpoint of step {resumed} back" in logs, logs[-3000:]
    # At most one interval computed again: the second attempt's first checkpoint is the next.
    after = [e for e in checkpoints_of(api, job) if e > resumed]
    interval = before[1] - before[0]
    assert after and after[0] == resumed + interval, (before, after)
    # Each checkpoint as the job's code named it, its size, the machine that made it.
    named = {"transformers": "checkpoint-{}"}[framework]
    assert [c["label"] for c in final["checkpoints"]] \
        == [named.format(c["epoch"]) for c in final["checkpoints"]]
    assert all(c["size"] > 0 and c["machine_id"] for c in final["checkpoints"])
    shown = subprocess.run([*CLI, "status", job], capture_output=True, text=True, timeout=60,
                           env=p.cli_env(), check=True).stdout
    newest = max(final["checkpoints"], key=lambda c: c["epoch"])
    assert any(line.startswith(f"ckpt     epoch {newest['epoch']} ")
               and line.endswith(named.format(newest["epoch"])) for line in shown.splitlines()), shown
