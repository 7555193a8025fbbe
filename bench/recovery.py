"""How long a job is down when its provider vanishes, at the default lease settings.

    .venv/bin/python bench/recovery.py [--rounds 3]     (as root, after infra/setup.sh)

Each round: a training job runs on one of two agents; once it has a checkpoint, that agent
is killed with SIGKILL. Measured: kill -> the job is RUNNING again on the other agent, and
kill -> its first resumed epoch. The baseline, measured in the same run on the same machine,
is a fresh job's submit -> RUNNING (build and sandbox start included), so the table shows
what a kill costs on top of simply starting the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train"
SPEC = JobSpec.from_dict({"env": {"EPOCHS": "1000", "EPOCH_SECONDS": "1"}})


def until(check, timeout: float = 180, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError


def run_log_epochs(api: Api, job_id: str, attempt: int) -> list[int]:
    out = []
    for c in api.logs(job_id)["chunks"]:
        if c["stream"] == "run" and c["attempt"] == attempt:
            out += [int(x.split()[1]) for x in c["text"].splitlines() if x.startswith("epoch ")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-"))
    os.chmod(root, 0o711)
    platform = Platform(root / "state", http_port=free_port()).start()  # default lease
    lease_s = platform.lease_seconds
    baseline, to_running, to_epoch = [], [], []
    try:
        agents = [platform.start_agent("bench-0"), platform.start_agent("bench-1")]
        api = Api(platform.url)
        for r in range(args.rounds):
            t0 = time.monotonic()
            job = api.submit(tar_folder(TRAIN), SPEC)["id"]
            until(lambda j=job: api.job(j)["state"] == "running")
            baseline.append(time.monotonic() - t0)
            until(lambda j=job: any(e["kind"] == "checkpoint" for e in api.job(j)["events"]))
            machine = api.job(job)["machine_id"]
            victim = next(a for a in agents if a.machine_id() == machine)
            os.kill(victim.pid(), signal.SIGKILL)
            killed = time.monotonic()
            until(lambda j=job: (s := api.job(j))["state"] == "running" and s["attempt"] == 2)
            to_running.append(time.monotonic() - killed)
            until(lambda j=job: run_log_epochs(api, j, 2))
            to_epoch.append(time.monotonic() - killed)
            api.cancel(job)
            victim.proc.wait(timeout=30)
            agents = [a for a in agents if a is not victim]
            agents.append(platform.start_agent(f"bench-{r + 2}"))
            time.sleep(2)
        api.close()
    finally:
        platform.stop()

    def row(name: str, xs: list[float]) -> str:
        return (f"| {name:<44} | {statistics.median(xs):7.2f} | {min(xs):7.2f} | {max(xs):7.2f} "
                f"| {statistics.median(xs) / statistics.median(baseline):6.2f}x |")

    print(f"\nrecovery after kill -9 of the running agent (lease {lease_s:.0f} s, renewed every "
          f"{lease_s / 4:.0f} s; {args.rounds} rounds)\n")
    print("| measurement                                  |  median |     min |     max | vs base |")
    print("|----------------------------------------------|---------|---------|---------|---------|")
    print(row("baseline: fresh job, submit -> running", baseline))
    print(row("kill -> running again on the other agent", to_running))
    print(row("kill -> first resumed epoch done", to_epoch))
    print(f"\nupper bound from the last renewal: kill -> running + {lease_s / 4:.0f} s "
          f"= {statistics.median(to_running) + lease_s / 4:.1f} s (median); target 20 s")


if __name__ == "__main__":
    main()
