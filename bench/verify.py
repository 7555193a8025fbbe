"""What verified results cost, and what they catch.

    .venv/bin/python bench/verify.py [--count 200] [--agents 3]     (as root, like ./infra/up)

Part 1, for real: the platform as `campugrid up` starts it, with N local agents (the provider
user's, real Podman, runsc and Buildah). A sweep of COUNT shards (each answers i * 2) is run
three times: with `verify` off (the baseline, in the same run), with `{"replicas": 2}`, and
with "adaptive" (the machines start with no trust, and earn it as the sweeps go). For each:
the wall time from submit to the last shard's end, and the shard runs (copies included)
against off's: the extra machine-time, since every run is the same work.

Part 2, the rules by simulation (coordinator/quorum.py's `simulate`, the very functions the
coordinator applies): over 1,000 machines with 50 liars lying on 1 %, 10 % or 100 % of their
tasks, the lies let through and the liars caught; and adaptive's extra machine-time with honest
machines once trust is earned (its steady state, which a short live run cannot reach).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.coordinator.quorum import simulate
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.verify import ADAPTIVE, Verify

MODES: dict[str, Any] = {"off": None, "replicas 2": {"replicas": 2}, "adaptive": "adaptive"}


def sweep(api: Api, context: Path, mode: str, count: int) -> dict[str, float]:
    """One sharded job of `count` shards (each answers i * 2), verified as `mode` says."""
    spec: dict[str, Any] = {
        "command": ["sh", "-c", 'echo $(( $(echo "$CAMPUGRID_SHARD_PAYLOAD" | tr -dc 0-9) * 2 ))'],
        "resources": {"cpus": 0.5, "memory_mb": 256, "wall_time_s": 600},
        "shards": [{"payload": i} for i in range(count)]}
    if MODES[mode] is not None:
        spec["verify"] = MODES[mode]
    began = time.perf_counter()
    job = api.submit(tar_folder(context), JobSpec.from_dict(spec))
    final = api.wait(job["id"], timeout_s=3600, poll_s=0.2, check=False)
    wall = time.perf_counter() - began
    shards = list(api.shards(job["id"]))
    wrong = [s["index"] for s in shards if s["result"] != s["index"] * 2]
    if final["state"] != "succeeded" or wrong:
        raise SystemExit(f"{mode}: the sweep ended {final['state']} ({final.get('reason')}); "
                         f"wrong results for shards {wrong[:10]}")
    runs = sum(len(s["copies"]) for s in shards) if MODES[mode] is not None else len(shards)
    return {"wall_s": wall, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200, help="shards in each sweep")
    ap.add_argument("--agents", type=int, default=3, help="local agents")
    ap.add_argument("--no-live", action="store_true", help="the simulation only")
    args = ap.parse_args()
    rows: dict[str, dict[str, float]] = {}
    if not args.no_live:
        root = Path(tempfile.mkdtemp(prefix="campugrid-verify-bench-"))
        os.chmod(root, 0o711)
        context = root / "job"
        context.mkdir()
        (context / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n")
        platform = Platform(root / "state", http_port=free_port(),
                            admin_identity=root / "admin.json").start()
        try:
            for n in range(args.agents):
                platform.start_agent(f"bench-{n}")
            with platform.api() as api:
                for mode in MODES:
                    rows[mode] = sweep(api, context, mode, args.count)
                    print(f"  {mode}: {rows[mode]['wall_s']:.1f} s", file=sys.stderr)
        finally:
            platform.stop()
            shutil.rmtree(root, ignore_errors=True)
        off = rows["off"]
        print(f"\nA sweep of {args.count} shards over {args.agents} local agents (gVisor, this "
              "machine), each mode in the same run\n")
        print("| verify       | wall s | shard runs | extra machine-time vs off |")
        print("|--------------|--------|------------|---------------------------|")
        for mode, r in rows.items():
            print(f"| {mode:<12} | {r['wall_s']:6.1f} | {r['runs']:10.0f} "
                  f"| {r['runs'] / off['runs'] - 1:+25.0%} |")
        print("\nadaptive here starts on machines with no trust (the two sweeps before it earn "
              "some): an untrusted machine's every answer is checked; the steady state is below.")

    print("\nThe rules by simulation: 1,000 machines, 50 of them liars (each lying alone), "
          "100,000 tasks\n")
    print("| verify     | liars lie on | lies let through | liars caught | liar tasks per liar caught       | extra machine-time |")
    print("|------------|--------------|------------------|--------------|---------------------------------|--------------------|")
    for name, verify in (("replicas 2", Verify(2, 2, 4)), ("adaptive", ADAPTIVE)):
        for rate in (0.01, 0.1, 1.0):
            sim = simulate(verify, machines=1000, liars=50, lie_rate=rate, tasks=100_000, seed=1)
            per = sim.liar_tasks / sim.caught if sim.caught else float("nan")
            print(f"| {name:<10} | {rate:12.0%} | {sim.wrong:16d} | {sim.caught:>6d} of {sim.liars:<3d} "
                  f"| {per:31.1f} | {sim.extra:+18.1%} |")
    steady = simulate(ADAPTIVE, machines=100, liars=0, lie_rate=0, tasks=100_000, seed=1,
                      count_from=50_000)
    early = simulate(ADAPTIVE, machines=100, liars=0, lie_rate=0, tasks=10_000, seed=1)
    print(f"\nadaptive, honest machines only (100 machines): extra machine-time {early.extra:+.1%} "
          f"over their first 100 tasks each, {steady.extra:+.1%} at steady state (tasks 50,001 to "
          "100,000; goal: at most +10 %)")


if __name__ == "__main__":
    main()
