"""The checkpoint hooks against the real frameworks (infra/frameworks-image.sh builds them):
each script of tests/frameworks (the Trainer's is examples/hf-trainer's), unchanged, run as a
job's Python runs it (the hooks' sitecustomize on PYTHONPATH, a checkpoint folder as the agent
mounts it), drained (SIGTERM) midway, then started again as a resumed attempt on another
machine starts: in a fresh folder holding only the checkpoint taken at the drain. It ends
with the weights of a run never stopped. The same four scripts killed with SIGKILL midway and
resumed from their newest checkpoint, through the platform and gVisor, are
tests/acceptance/test_frameworks.py (a kill on the host here repeated it, a minute longer)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from campugrid import hooks
from campugrid.hooks import autosave

pytestmark = pytest.mark.integration
SCRIPTS = Path(__file__).resolve().parents[1] / "frameworks"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf-trainer"
HOOKS = Path(hooks.__file__).resolve().parent
SITE = Path(os.environ.get("CAMPUGRID_FRAMEWORKS_SITE", "/var/cache/campugrid/frameworks-v1"))
# What each script saves, where, and at which steps.
SAVES = {"transformers": (EXAMPLE / "train.py", [10, 20, 30, 40]),
         "lightning": (SCRIPTS / "train_lightning.py", [16, 32, 48, 64]),
         "keras": (SCRIPTS / "train_keras.py", [16, 32, 48, 64]),
         "plain": (SCRIPTS / "train_plain.py", [10, 20, 30, 40, 50, 60])}
PLAIN_FOLDER = {autosave.ENV_MATCH: "step_*.pt"}  # + ENV_FROM: the job's ckpt/


@pytest.fixture(scope="module")
def python_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The hooks as the agent mounts them (sitecustomize.py beside campugrid/hooks), then the
    frameworks."""
    if not (SITE / ".complete").exists():
        pytest.fail(f"{SITE} is missing: infra/test makes it (infra/frameworks-image.sh)")
    root = tmp_path_factory.mktemp("hooks")
    (root / "campugrid").mkdir()
    shutil.copytree(HOOKS, root / "campugrid" / "hooks")
    shutil.copy(HOOKS / "sitecustomize.py", root / "sitecustomize.py")
    return f"{root}:{SITE}"


class Run:
    """One attempt of a script: `app` is its working folder (the same path on every machine,
    as an image's WORKDIR is), `checkpoints` the folder the agent mounts."""

    def __init__(self, python_path: str, framework: str, app: Path, checkpoints: Path,
                 step_seconds: float = 0.0, resumed: int | None = None,
                 drain_at: int | None = None) -> None:
        script, _ = SAVES[framework]
        env = {"PATH": os.environ["PATH"], "HOME": str(app), "PYTHONPATH": python_path,
               "OMP_NUM_THREADS": "1", "STEP_SECONDS": str(step_seconds),
               hooks.ENV_DIR: str(checkpoints), "KERAS_BACKEND": "torch"}
        if drain_at is not None:
            env["DRAIN_AT_STEP"] = str(drain_at)
        if framework == "plain":
            env |= PLAIN_FOLDER | {autosave.ENV_FROM: str(app / "ckpt")}
        if resumed is not None:
            env[autosave.ENV_RESUMED] = str(resumed)
        self.checkpoints = checkpoints
        app.mkdir(parents=True, exist_ok=True)
        self.log = app.parent / f"{app.name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["/usr/bin/python3", str(script)], cwd=app,
                                         env=env, stdout=out, stderr=subprocess.STDOUT)

    def taken(self) -> list[int]:
        if not self.checkpoints.exists():
            return []
        return [int(p.name[len(hooks.PREFIX):]) for p in hooks.complete(self.checkpoints)]

    def wait_for_checkpoints(self, n: int, timeout_s: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while len(self.taken()) < n:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        return self.taken()

    def finish(self, timeout_s: float = 240) -> dict:
        assert self.proc.wait(timeout=timeout_s) == 0, self.output()
        return json.loads(self.output().strip().splitlines()[-1])

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def resume(python_path: str, framework: str, before: Run, app: Path, into: Path) -> Run:
    """Another machine's attempt: the job's folder as its image has it (empty), and only the
    newest checkpoint taken, unpacked where the agent unpacks it."""
    newest = before.taken()[-1]
    shutil.rmtree(app)
    into.mkdir()
    shutil.copytree(before.checkpoints / hooks.folder_name(newest),
                    into / hooks.folder_name(newest))
    return Run(python_path, framework, app, into, resumed=newest)


@pytest.mark.parametrize("framework", ["transformers", "lightning", "keras"])
def test_a_drain_saves_at_the_drain_and_the_run_goes_on_from_there_exactly(
        python_path, tmp_path, framework):
    """SIGTERM midway between two saves: the framework saves at the current step and the job
    exits 143; resumed from that checkpoint on another machine, it ends with the weights of a
    run never stopped (Lightning's shuffled DataLoader, which Lightning itself cannot resume
    mid-epoch, and Keras's pass over its shuffled arrays, which Keras resumes only at an
    epoch's start, draw the same batches again and skip those trained)."""
    never_stopped = Run(python_path, framework, tmp_path / "reference" / "app",
                        tmp_path / "reference" / "checkpoints")
    app = tmp_path / "job" / "app"
    run = Run(python_path, framework, app, tmp_path / "job" / "ckpt-1", step_seconds=0.1)
    _, saves = SAVES[framework]
    run.wait_for_checkpoints(1)
    time.sleep(0.6)  # into the next interval
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=60) == autosave.DRAINED, run.output()
    drained_at = run.taken()[-1]
    assert drained_at not in saves, (run.taken(), run.output()[-3000:])  # not an interval
    assert f"drained: the checkpoint of step {drained_at} is taken" in run.output()
    again = resume(python_path, framework, run, app, tmp_path / "job" / "ckpt-2")
    assert again.finish() == never_stopped.finish(), again.output()[-3000:]
    if framework != "transformers":
        assert "the training data goes on at batch " in again.output(), again.output()[-3000:]
    assert again.taken()[0] == drained_at
    assert again.taken()[1:] == [s for s in saves if s > drained_at]


@pytest.mark.parametrize("framework", ["lightning", "keras"])
def test_a_drain_on_an_epochs_last_batch_saves_where_the_run_can_go_on_exactly(
        python_path, tmp_path, framework):
    """Drained during the last batch of the first epoch (16 batches): there is no pass of the
    data left to skip into, so Lightning saves after the next epoch's first batch, Keras with
    the epoch's own backup; either way the resumed run ends as one never stopped."""
    never_stopped = Run(python_path, framework, tmp_path / "reference" / "app",
                        tmp_path / "reference" / "checkpoints")
    app = tmp_path / "job" / "app"
    run = Run(python_path, framework, app, tmp_path / "job" / "ckpt-1", drain_at=15)
    assert run.proc.wait(timeout=120) == autosave.DRAINED, run.output()
    assert run.taken()[-1] == {"lightning": 17, "keras": 16}[framework], run.output()[-3000:]
    again = resume(python_path, framework, run, app, tmp_path / "job" / "ckpt-2")
    assert again.finish() == never_stopped.finish(), again.output()[-3000:]


def test_a_drained_plain_loop_keeps_what_it_had_written(python_path, tmp_path):
    """A file the loop finished writing a moment before the drain is taken at the drain: the
    watch had seen it once, unchanged, but not yet for SETTLE_S."""
    run = Run(python_path, "plain", tmp_path / "app", tmp_path / "checkpoints",
              step_seconds=0.3)  # 3 s between its files
    written = tmp_path / "app" / "ckpt" / "step_00020.pt"
    deadline = time.monotonic() + 120
    while not written.exists():
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()
        time.sleep(0.02)
    time.sleep(autosave.EVERY_S + 0.3)  # one look at it, well before SETTLE_S
    assert 20 not in run.taken()
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=60) == autosave.DRAINED, run.output()
    assert run.taken()[-1] == 20


def test_a_hooked_trainer_keeps_its_signature(python_path, tmp_path):
    """Lightning reads its Trainer's signature for PL_TRAINER_* defaults and positional
    arguments (and LightningCLI builds its options from it): the hooks' wrappers keep it."""
    code = ("import inspect, lightning as L\n"
            "t = L.Trainer('cpu', logger=False, enable_progress_bar=False)\n"
            "print(t.max_epochs, type(t.accelerator).__name__,\n"
            "      'max_epochs' in inspect.signature(L.Trainer).parameters)\n")
    done = subprocess.run(["/usr/bin/python3", "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={
                              "PATH": os.environ["PATH"], "HOME": str(tmp_path),
                              "PYTHONPATH": python_path, "PL_TRAINER_MAX_EPOCHS": "3",
                              hooks.ENV_DIR: str(tmp_path / "checkpoints")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["3", "CPUAccelerator", "True"], done.stdout
    assert (tmp_path / "checkpoints" / autosave.FRAMEWORK).read_text() == "lightning"
