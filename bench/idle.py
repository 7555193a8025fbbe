"""What an idle provider costs its owner: CPU and memory of a registered agent with no work,
against gpumesh 3.2.0's idle worker (`gpumesh join`), watched at the same time.

    .venv/bin/python bench/idle.py [--seconds 300]     (as root, after infra/setup.sh)

Both run their default settings against their own coordinator on this machine. Counted: the
worker's whole process tree (for campugrid: the agent, its Podman API service and its
guards), CPU over the window and resident memory sampled once a second. gpumesh is installed
into bench/.peers/gpumesh by its driver (PyPI) on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))
from gpumesh_driver import watch_idle  # noqa: E402  (the same sampler for both)


def campugrid_idle(seconds: float, out: dict[str, Any], ready: threading.Event) -> None:
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-idle-"))
    os.chmod(root, 0o711)
    platform = Platform(root / "state", http_port=free_port()).start()
    try:
        agent = platform.start_agent("bench-idle")
        deadline = time.monotonic() + 120
        while "registered as" not in (agent.log_file.read_text() if agent.log_file else ""):
            if time.monotonic() > deadline:
                raise TimeoutError("the agent did not register")
            time.sleep(0.2)
        ready.set()
        time.sleep(5)  # past its start-up (speed score, sweeps, the API service)
        out.update(watch_idle(agent.pid(), seconds))
    finally:
        ready.set()
        platform.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300.0)
    args = ap.parse_args()
    ours: dict[str, Any] = {}
    ready = threading.Event()
    thread = threading.Thread(target=campugrid_idle, args=(args.seconds, ours, ready))
    thread.start()
    ready.wait()
    peer = subprocess.run([sys.executable, str(BENCH / "peers" / "gpumesh_driver.py"),
                           "--venv", str(BENCH / ".peers" / "gpumesh"), "--mode", "idle",
                           "--seconds", str(args.seconds)],
                          capture_output=True, text=True, timeout=args.seconds + 900)
    thread.join()
    theirs = json.loads(peer.stdout.strip().splitlines()[-1]) if peer.stdout.strip() else {}
    if "error" in theirs or not theirs:
        print(peer.stderr[-2000:], file=sys.stderr)
    print(f"\nan idle, registered provider over {args.seconds:.0f} s, watched at the same time "
          "(the whole process tree)\n")
    print("| worker                    | CPU % of a core | CPU s | RSS MB median | RSS MB max | processes |")
    print("|---------------------------|-----------------|-------|---------------|------------|-----------|")
    for name, got in (("campugrid agent", ours), ("gpumesh 3.2.0 join (base)", theirs)):
        if "cpu_pct" not in got:
            print(f"| {name:<25} | {'error: ' + str(got.get('error', 'no result')):<60} |")
            continue
        print(f"| {name:<25} | {got['cpu_pct']:15.3f} | {got['cpu_s']:5.2f} | "
              f"{got['rss_mb_median']:13.1f} | {got['rss_mb_max']:10.1f} | {got['processes']:9d} |")
    if "cpu_pct" in ours and "cpu_pct" in theirs and theirs["cpu_pct"] > 0:
        print(f"\ncampugrid / gpumesh: CPU {ours['cpu_pct'] / theirs['cpu_pct']:.2f}x, "
              f"memory {ours['rss_mb_median'] / theirs['rss_mb_median']:.2f}x")


if __name__ == "__main__":
    main()
