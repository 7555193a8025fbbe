"""How long a job is down when its provider vanishes, at the default lease settings.

    .venv/bin/python bench/recovery.py [--rounds 3]     (as root, after infra/test's set-up)

Two jobs: examples/train (checkpoints through campugrid.hooks every epoch) and the unchanged
Hugging Face Trainer script of examples/hf-trainer (checkpoints taken as the Trainer saves
them, every 10 steps; run from the frameworks image that infra/frameworks-image.sh makes, as
PyPI's PyTorch takes too long to build here). Each round: the job runs on one of two agents;
once it has a checkpoint, that agent is killed with SIGKILL. Measured: kill -> the job is
RUNNING again on the other agent, and kill -> its first epoch (or Trainer step) after the
checkpoint is done. The baseline, measured in the same run on the same machine, is a fresh
job's submit -> RUNNING (its image built in the first round, then found on the machine, as it
is for the rescheduled job; the sandbox's start included), so the table shows what a kill
costs on top of simply starting the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from campugrid.cli.platform import BASE_IMAGE, AgentHandle, Platform, ProviderUser
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train"
SPEC = JobSpec.from_dict({"env": {"EPOCHS": "1000", "EPOCH_SECONDS": "1"}})
FRAMEWORKS = "localhost/campugrid/frameworks:v1"
TRAINER_SPEC = JobSpec.from_dict({
    "command": ["python3", "train.py"], "checkpoints": {"dir": "/app/outputs"},
    "env": {"STEP_SECONDS": "1", "OMP_NUM_THREADS": "1"}, "resources": {"memory_mb": 2048}})


def until(check, timeout: float = 300, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError


def run_log(api: Api, job_id: str, attempt: int) -> str:
    return "".join(c["text"] for c in api.logs(job_id)["chunks"] if c["attempt"] == attempt)


def epoch_done(api: Api, job_id: str) -> bool:
    return any(line.startswith("epoch ") for line in run_log(api, job_id, 2).splitlines())


def trainer_step_done(api: Api, job_id: str) -> bool:
    return "went on from the checkpoint put back" in run_log(api, job_id, 2)


def trainer_context(root: Path) -> bytes:
    """The example's script, unchanged, on the frameworks image instead of its own build."""
    if subprocess.run(ProviderUser.resolve().command(["podman", "image", "exists", FRAMEWORKS]),
                      timeout=60).returncode != 0:
        raise SystemExit(f"{FRAMEWORKS} is missing: ./infra/test's set-up makes it "
                         "(infra/frameworks-image.sh)")
    folder = root / "hf-trainer"
    folder.mkdir()
    (folder / "train.py").write_bytes((REPO / "examples" / "hf-trainer" / "train.py").read_bytes())
    (folder / "Dockerfile").write_text(f"FROM {FRAMEWORKS}\nWORKDIR /app\nCOPY train.py .\n")
    return tar_folder(folder)


def rounds(platform: Platform, api: Api, agents: list[AgentHandle], context: bytes,
           spec: JobSpec, went_on: Callable[[Api, str], bool], n: int,
           ) -> tuple[list[float], list[float], list[float]]:
    """n kills of the agent running a fresh job: (submit -> running, kill -> running again,
    kill -> first progress after the checkpoint)."""
    baseline, to_running, to_progress = [], [], []
    for _ in range(n):
        t0 = time.monotonic()
        job = api.submit(context, spec)["id"]
        until(lambda j=job: api.job(j)["state"] == "running")
        baseline.append(time.monotonic() - t0)
        until(lambda j=job: any(e["kind"] == "checkpoint" for e in api.job(j)["events"]))
        machine = api.job(job)["machine_id"]
        victim = next(a for a in agents if a.machine_id() == machine)
        os.kill(victim.pid(), signal.SIGKILL)
        killed = time.monotonic()
        until(lambda j=job: (s := api.job(j))["state"] == "running" and s["attempt"] == 2)
        to_running.append(time.monotonic() - killed)
        until(lambda j=job: went_on(api, j))
        to_progress.append(time.monotonic() - killed)
        api.cancel(job)
        victim.proc.wait(timeout=30)
        agents.remove(victim)
        agents.append(platform.start_agent(f"bench-{len(platform.agents)}"))
        time.sleep(2)
    return baseline, to_running, to_progress


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-"))
    os.chmod(root, 0o711)
    os.environ["CAMPUGRID_ALLOWED_BASES"] = f"{BASE_IMAGE},{FRAMEWORKS}"
    trainer = trainer_context(root)
    platform = Platform(root / "state", http_port=free_port()).start()  # default lease
    lease_s = platform.lease_seconds
    try:
        agents = [platform.start_agent("bench-0"), platform.start_agent("bench-1")]
        with platform.api() as api:
            hooks = rounds(platform, api, agents, tar_folder(TRAIN), SPEC, epoch_done,
                           args.rounds)
            unchanged = rounds(platform, api, agents, trainer, TRAINER_SPEC, trainer_step_done,
                               args.rounds)
    finally:
        platform.stop()

    def row(name: str, xs: list[float], baseline: list[float]) -> str:
        return (f"| {name:<68} | {statistics.median(xs):7.2f} | {min(xs):7.2f} | {max(xs):7.2f} "
                f"| {statistics.median(xs) / statistics.median(baseline):6.2f}x |")

    print(f"\nrecovery after kill -9 of the running agent (lease {lease_s:.0f} s, renewed every "
          f"{lease_s / 4:.0f} s; {args.rounds} rounds each)\n")
    print(f"| {'measurement':<68} |  median |     min |     max | vs base |")
    print(f"|{'-' * 70}|---------|---------|---------|---------|")
    for name, (baseline, to_running, to_progress), unit in (
            ("examples/train (campugrid.hooks)", hooks, "epoch"),
            ("examples/hf-trainer (unchanged Trainer)", unchanged, "step")):
        print(row(f"{name}: baseline, submit -> running", baseline, baseline))
        print(row(f"{name}: kill -> running again", to_running, baseline))
        print(row(f"{name}: kill -> first resumed {unit} done", to_progress, baseline))
    print(f"\nupper bound from the last renewal: kill -> running + {lease_s / 4:.0f} s "
          f"= {statistics.median(hooks[1]) + lease_s / 4:.1f} s (median); target 20 s")


if __name__ == "__main__":
    main()
