"""A short job's turn on one agent: from its submit to the agent ready for the next.

    .venv/bin/python bench/turns.py [--jobs 8]          (as root, after infra/setup.sh)

The platform as `campugrid up` starts it, one agent as the provider user. Jobs of the Python
base whose command is `true` run one after the other (the next submitted once the one before
succeeded), two ways in the same run, alternating:
  - same context: every job built from the same Dockerfile (a sweep's jobs): the same image
    ID each time;
  - new context: each job's Dockerfile sets an ENV of its own, so each builds a new image.
(While sandboxes ran `--userns keep-id`, a new image's first start wrote an ID-mapped copy of
the whole image and its removal deleted it, and the agent kept a task's image until the next
task had ended, for the same context's next job: 1.25 s against 5.37 s a turn, 2026-12-07.)
A turn is measured from a job's submit to the next job's lease, which is submitted once the
one before succeeded (so it includes the agent's sweep after a job), by the coordinator's own
event times; the table shows the median and the slowest.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from campugrid.cli.platform import Platform  # noqa: E402
from campugrid.cli.seaweed import free_port  # noqa: E402
from campugrid.client import Api, tar_folder  # noqa: E402
from campugrid.protocol.spec import JobSpec  # noqa: E402

BASE = "localhost/campugrid/python:bookworm"


def turns(api: Api, folder: Path, jobs: int, new_context: bool) -> list[float]:
    """Seconds from each job's submit to its successor's lease, by the jobs' own events. The
    first job is not measured: it follows the other way's last (another image)."""
    times: list[tuple[float, float]] = []  # (submitted, leased) of each job
    for _ in range(jobs + 2):  # the first, and one more: the last turn ends at its lease
        (folder / "Dockerfile").write_text(f"FROM {BASE}\n"
                                           + (f"ENV TURN={time.time_ns()}\n" if new_context else ""))
        job = api.submit(tar_folder(folder), JobSpec.from_dict({"command": ["true"]}))
        final = api.wait(job["id"], timeout_s=240, poll_s=0.05)
        assert final["state"] == "succeeded", final
        at = {e["kind"]: dt.datetime.fromisoformat(e["at"]).timestamp() for e in final["events"]}
        times.append((at["submitted"], at["leased"]))
    return [times[n + 1][1] - times[n][0] for n in range(1, jobs + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=8, help="turns measured each way")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-turns-"))
    os.chmod(root, 0o711)
    folder = root / "context"
    folder.mkdir()
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        p.start_agent("bench-agent")
        results: dict[str, list[float]] = {"same context": [], "new context": []}
        with p.api() as api:
            turns(api, folder, 0, False)  # the agent's cold start is no turn's
            for _ in range(2):  # alternating halves: neither way gets the quieter minutes
                for name in results:
                    results[name] += turns(api, folder, args.jobs // 2, name == "new context")
    finally:
        p.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'jobs of the Python base, command true':<40} {'turns':>5} {'median s':>9} "
          f"{'slowest s':>9}")
    for name, seconds in results.items():
        print(f"{name:<40} {len(seconds):>5} {statistics.median(seconds):>9.2f} "
              f"{max(seconds):>9.2f}")
    same, new = (statistics.median(results[k]) for k in ("same context", "new context"))
    print(f"\nthe same context's turn is {same / new:.2f}x a new context's")


if __name__ == "__main__":
    main()
