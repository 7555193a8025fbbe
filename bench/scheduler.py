"""Lease latency and throughput against queue depth and machine count, over real gRPC.

    .venv/bin/python bench/scheduler.py [--leases 300] [--threads 8] [--database-url URL]

A coordinator (SQLite by default, or --database-url) with an embedded S3 server is seeded
with N queued CPU jobs and M registered machines; agents' own client then asks for leases
from T threads, each lease a real claim (guarded update, event, presigned URLs). The table
shows median/p95 latency and leases per second for each (N, M). The peer, gpumesh 3.2.0
from PyPI, is measured in the same run on the same machine (bench/peers/gpumesh_driver.py)
and the ratio printed; pass --no-peer to skip it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import insert

from campugrid.agent.client import CoordinatorClient
from campugrid.coordinator import server
from campugrid.coordinator.config import Settings
from campugrid.coordinator.models import Job, Machine
from campugrid.coordinator.seaweed import EmbeddedS3, free_port
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState

BENCH = Path(__file__).resolve().parent
DEPTHS = (1_000, 10_000, 100_000)
MACHINES = (10, 100, 1000)


def seed_jobs(running: server.Running, count: int) -> None:
    spec = JobSpec.from_dict({"command": ["true"]}).to_json()
    now = dt.datetime.now(dt.UTC)
    rows = [{"id": str(uuid.uuid4()), "client_job_id": None, "name": None,
             "state": JobState.QUEUED.value, "spec_json": spec, "context_key": "contexts/x.tar",
             "context_sha256": "0" * 64, "attempt": 0, "max_attempts": 3, "drained": 0,
             "gpus_needed": 0, "created_at": now + dt.timedelta(microseconds=i),
             "updated_at": now} for i in range(count)]
    with running.coord.store.engine.begin() as conn:
        for i in range(0, count, 5000):
            conn.execute(insert(Job), rows[i:i + 5000])


def seed_machines(running: server.Running, count: int) -> list[tuple[str, str]]:
    now = dt.datetime.now(dt.UTC)
    creds = [(str(uuid.uuid4()), uuid.uuid4().hex) for _ in range(count)]
    with running.coord.store.engine.begin() as conn:
        conn.execute(insert(Machine), [
            {"id": m, "name": f"bench-{i}", "secret_sha256": hashlib.sha256(s.encode()).hexdigest(),
             "capabilities_json": "{}", "gpus_json": "{}", "registered_at": now,
             "last_seen_at": now} for i, (m, s) in enumerate(creds)])
    return creds


def measure(address: str, creds: list[tuple[str, str]], leases: int, threads: int) -> dict[str, float]:
    """Latency from one client asking in turn (as gpumesh's driver does), throughput from
    `threads` clients at once."""
    alone = _run(address, creds, leases // 3, 1)
    together = _run(address, creds, leases, threads)
    return {"median_ms": alone["median_ms"], "p95_ms": alone["p95_ms"],
            "per_s": together["per_s"], "busy_p95_ms": together["p95_ms"]}


def _run(address: str, creds: list[tuple[str, str]], leases: int, threads: int) -> dict[str, float]:
    clients = []
    for m, s in creds:
        c = CoordinatorClient(address, Path(os.devnull))
        c.machine_id, c._secret = m, s
        clients.append(c)
    latencies: list[float] = []
    lock = threading.Lock()
    rng = random.Random(1)

    def one(_: int) -> None:
        with lock:
            c = rng.choice(clients)
        t = time.perf_counter()
        reply = c.lease()
        took = time.perf_counter() - t
        assert reply.has_task
        with lock:
            latencies.append(took)

    for _ in range(20):  # warm-up: connections, caches
        one(0)
    latencies.clear()
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(leases)))
    wall = time.perf_counter() - started
    for c in clients:
        c.close()
    latencies.sort()
    return {"median_ms": statistics.median(latencies) * 1000,
            "p95_ms": latencies[int(len(latencies) * 0.95) - 1] * 1000, "per_s": leases / wall}


def peer(queued: int) -> dict[str, float] | None:
    driver = BENCH / "peers" / "gpumesh_driver.py"
    if not driver.exists():
        return None
    out = subprocess.run([sys.executable, str(driver), "--venv", str(BENCH / ".peers" / "gpumesh"),
                          "--mode", "lease", "--queued", str(queued)],
                         capture_output=True, text=True, timeout=600)
    try:
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        print(f"gpumesh driver failed: {out.stderr[-500:]}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leases", type=int, default=300)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="campugrid-sched-"))
    s3 = EmbeddedS3(root / "s3", "bench", uuid.uuid4().hex).start()
    settings = Settings.from_env(root / "coord", s3_endpoint=s3.endpoint, s3_access_key="bench",
                                 s3_secret_key=s3.secret_key, http_port=free_port(),
                                 grpc_port=free_port(), lease_seconds=600,
                                 **({"database_url": args.database_url} if args.database_url else {}))
    running = server.start(settings)
    address = f"127.0.0.1:{running.grpc_port}"
    rows = []
    try:
        creds = seed_machines(running, max(MACHINES))
        seeded = 0
        for depth in DEPTHS:
            seed_jobs(running, depth - seeded + 2 * args.leases * len(MACHINES) + 60 * len(MACHINES))
            seeded = depth
            for machines in MACHINES:
                r = measure(address, creds[:machines], args.leases, args.threads)
                rows.append((depth, machines, r))
                print(f"  measured {depth} queued, {machines} machines: {r['median_ms']:.2f} ms",
                      file=sys.stderr)
    finally:
        running.stop()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    peers = {} if args.no_peer else {d: peer(min(d, 50_000)) for d in DEPTHS}
    db = "PostgreSQL" if args.database_url else "SQLite"
    print(f"\nlease over gRPC on loopback, {db}: latency from one client asking in turn; "
          f"leases/s from {args.threads} clients at once ({args.leases} leases per row)\n")
    print("| queued  | machines | median ms | p95 ms | leases/s | p95 ms busy | gpumesh median ms (queued) | ratio |")
    print("|---------|----------|-----------|--------|----------|-------------|----------------------------|-------|")
    for depth, machines, r in rows:
        p = peers.get(depth)
        pm = f"{p['median_ms']:.2f} ({p['queued']})" if p else "n/a"
        ratio = f"{p['median_ms'] / r['median_ms']:.1f}x" if p else "n/a"
        print(f"| {depth:>7} | {machines:>8} | {r['median_ms']:9.2f} | {r['p95_ms']:6.2f} "
              f"| {r['per_s']:8.0f} | {r['busy_p95_ms']:11.2f} | {pm:>26} | {ratio:>5} |")
    print("\nratio: gpumesh's median lease latency over ours, same machine, same run "
          "(higher is better for campugrid)")


if __name__ == "__main__":
    main()
