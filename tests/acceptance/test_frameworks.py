"""Checkpoints of training code that never heard of campugrid, through the platform: four
unchanged scripts (the Hugging Face Trainer of examples/hf-trainer; Lightning, Keras and a plain
PyTorch loop of tests/frameworks), in the frameworks image that infra/frameworks-image.sh
makes, run by real agents under gVisor, all four at once, one to an agent. Each job's agent
is killed (SIGKILL) after its first checkpoint; another agent finishes the job from the newest,
having lost at most one checkpoint interval, with the weights of a run never stopped. The
hooks' drains on the host, each framework on its own (each saves at the drain and resumes
from it to the same weights), are tests/integration/test_framework_hooks.py; an agent's drain
is tests/acceptance/test_resilience.py's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from campugrid.cli.platform import BASE_IMAGE, Platform
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.acceptance.test_resilience import checkpoints_of, holder, platform_with
from tests.integration.test_framework_hooks import SAVES, SCRIPTS, SITE
from tests.support.console import CLI

pytestmark = pytest.mark.acceptance
IMAGE = "localhost/campugrid/frameworks:v1"
# What each job's spec says: its script, and where its framework writes (the image's root is
# read-only in the sandbox, so the folder is named to have it writable; the plain loop's is
# also the one the watch takes its files from).
JOBS = {
    "transformers": {"command": ["python3", "train_hf.py"],
                     "checkpoints": {"dir": "/app/outputs"}},
    "lightning": {"command": ["python3", "train_lightning.py"],
                  "checkpoints": {"dir": "/app/checkpoints"}},
    "keras": {"command": ["python3", "train_keras.py"], "checkpoints": {"dir": "/app/backup"}},
    "plain": {"command": ["python3", "train_plain.py"],
              "checkpoints": {"dir": "/app/ckpt", "match": "step_*.pt"}},
}
ENV = {"OMP_NUM_THREADS": "1"}  # the same arithmetic in the sandbox as on the host
# A step's pause: a checkpoint interval takes 2.5-5 s, so that a stop falls within one, and
# the kill comes well before the end, however busy the machine.
STEP_SECONDS = {"transformers": "0.4", "lightning": "0.25", "keras": "0.25", "plain": "0.4"}


@pytest.fixture(scope="module")
def grid() -> Iterator[tuple[Platform, Api]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAMPUGRID_ALLOWED_BASES", f"{BASE_IMAGE},{IMAGE}")
        # Four PyTorch jobs under gVisor on two cores: a lease of 4 s (the other tests')
        # could expire while an agent's renewals wait for a CPU.
        with platform_with({f"first-{f}": () for f in JOBS}, lease_seconds=15.0) as running:
            yield running


def context(tmp_path: Path) -> bytes:
    """The four scripts and the image of tests/frameworks; the Trainer's is the example's."""
    folder = tmp_path / "context"
    shutil.copytree(SCRIPTS, folder)
    shutil.copy(SAVES["transformers"][0], folder / "train_hf.py")
    return tar_folder(folder)


def never_stopped(framework: str, tmp_path: Path) -> str:
    """The weights of an uninterrupted run, on the host (the same packages as the image)."""
    folder = tmp_path / f"reference-{framework}"
    folder.mkdir()
    done = subprocess.run(["/usr/bin/python3", str(SAVES[framework][0])], cwd=folder,
                          env={"PATH": os.environ["PATH"], "HOME": str(folder),
                               "PYTHONPATH": str(SITE), "KERAS_BACKEND": "torch", **ENV},
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["weights"]


def explain(api: Api, job: str) -> str:
    said = api.job(job)
    logs = "".join(c["text"] for c in api.logs(job)["chunks"])
    return f"{said['state']} {said.get('reason')}\n{logs[-4000:]}"


def each_as_soon_as(api: Api, ids: dict[str, str], ready: Callable[[str], bool],
                    act: Callable[[str], None], timeout: float = 240) -> None:
    """`act` on each job (by its framework) the moment `ready` holds for it."""
    waiting, deadline = dict(ids), time.monotonic() + timeout
    while waiting:
        for f in list(waiting):
            if ready(f):
                act(f)
                del waiting[f]
        if time.monotonic() > deadline:
            raise AssertionError("\n".join(explain(api, job) for job in waiting.values()))
        time.sleep(0.2)


def run_log(api: Api, job: str, attempt: int) -> str:
    return "".join(c["text"] for c in api.logs(job)["chunks"] if c["attempt"] == attempt)


def test_unchanged_scripts_killed_midway_finish_elsewhere_as_if_never_stopped(grid, tmp_path):
    p, api = grid
    ids = {f: api.submit(context(tmp_path / f), JobSpec.from_dict({
        **spec, "env": {**ENV, "STEP_SECONDS": STEP_SECONDS[f]},
        "resources": {"memory_mb": 2048}, "image": {"reuse": "never"}}))["id"]
        for f, spec in JOBS.items()}
    killed_at: dict[str, int] = {}  # the newest checkpoint recorded when its agent was killed

    def kill(f: str) -> None:
        os.kill(holder(p, api, ids[f]).pid(), signal.SIGKILL)
        killed_at[f] = max(checkpoints_of(api, ids[f]))
        p.start_agent(f"after-{f}")  # for the attempt that follows

    with ThreadPoolExecutor(2) as pool:  # meanwhile, on the host
        expected = {f: pool.submit(never_stopped, f, tmp_path) for f in JOBS}
        # On a machine that never built FROM the frameworks image, the first build copies its
        # 6 GB into the builder's store of allowed bases first (2-3 minutes here).
        each_as_soon_as(api, ids, lambda f: len(checkpoints_of(api, ids[f])) >= 1, kill,
                        timeout=420)
        for f, job in ids.items():
            final = api.wait(job, timeout_s=300, poll_s=0.3, check=False)
            assert final["state"] == "succeeded", explain(api, job)
            assert final["attempt"] >= 2, final["events"]
            assert json.loads(final["result"])["weights"] == expected[f].result(), f
            # It went on from the newest checkpoint recorded before the kill...
            resumed, logs = killed_at[f], run_log(api, job, 2)
            assert f"resuming from the checkpoint of epoch {resumed}" in logs, logs[-3000:]
            assert f"put the checkpoint of step {resumed} back" in logs, logs[-3000:]
            if f != "plain":  # a framework's hook says when the first step after it is done
                assert "went on from the checkpoint put back: step " in logs, logs[-3000:]
            # ... and lost at most one interval: the next it recorded is the next save.
            _, saves = SAVES[f]
            later = [e for e in checkpoints_of(api, job) if e > resumed]
            assert later and later[0] == min(e for e in saves if e > resumed), (f, later)
            # Each checkpoint with its name, its size, the machine that made it.
            assert all(c["size"] > 0 and c["machine_id"] and c["label"]
                       for c in final["checkpoints"]), final["checkpoints"]

    # As the job's code named it: the Trainer's checkpoint-<step> folders, in REST and the CLI.
    hf = api.job(ids["transformers"])
    assert {c["label"] for c in hf["checkpoints"]} \
        == {f"checkpoint-{c['epoch']}" for c in hf["checkpoints"]}
    shown = subprocess.run([*CLI, "status", ids["transformers"]], capture_output=True,
                           text=True, timeout=60, env=p.cli_env(), check=True).stdout
    newest = max(hf["checkpoints"], key=lambda c: c["epoch"])
    assert any(line.startswith(f"ckpt     epoch {newest['epoch']} ")
               and line.endswith(f"checkpoint-{newest['epoch']}")
               for line in shown.splitlines()), shown
