"""Lease latency and throughput against queue depth and machine count, over real gRPC.

    .venv/bin/python bench/scheduler.py [--leases 300] [--threads 8] [--database-url URL]

A coordinator (SQLite by default, or --database-url) with an embedded S3 server is seeded
with N queued CPU jobs and M registered machines; agents' own client then asks for leases
from T threads, each lease a real claim (guarded update, event, presigned URLs). The table
shows median/p95 latency and leases per second for each (N, M). The peer, gpumesh 3.2.0
from PyPI, is measured in the same run on the same machine (bench/peers/gpumesh_driver.py)
and the ratio printed; pass --no-peer to skip it.

A second table, in the same run, has 1, 2 and 4 `campugrid coordinator serve` processes on
one throwaway PostgreSQL (--coordinators; 0 skips it), the client processes spread over
them, beside the single SQLite process's row for the same queue.

A last row in both tables, "floor", is the same clients' same signed calls answered by a
grpcio server that does nothing but return a lease reply made earlier: what gRPC, TLS and
protobuf alone cost here, the ceiling for any coordinator on grpcio's Python server.

Host speed: these VMs' effective CPU speed drifts by up to 2x within seconds (a fixed
pure-Python loop takes 180 to 330 ms of CPU on an idle machine), which once looked like
rows of this benchmark costing 2.5 ms of CPU per lease instead of 1.0. So every row also
times that fixed loop just before and after its measurement ("host ms"), and the CPU per
lease is also given scaled to the run's fastest host reading ("at best speed"): compare
rows by that column.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
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
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from sqlalchemy import Engine, create_engine, insert, text

from campugrid.agent.client import pinned_channel, signed_metadata
from campugrid.cli.seaweed import EmbeddedS3, free_port
from campugrid.coordinator import server
from campugrid.coordinator.config import Settings
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.models import Job, Machine
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import keys
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from campugrid.protocol.wire import MACHINE_HEADER

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.postgres import TempPostgres  # the repository's own helper

HEARTBEAT = "/campugrid.v1.AgentService/Heartbeat"
LEASE = "/campugrid.v1.AgentService/Lease"

BENCH = Path(__file__).resolve().parent
DEPTHS = (1_000, 10_000, 100_000)
MACHINES = (10, 100, 1000)


def seed_jobs(engine: Engine, count: int) -> None:
    spec = JobSpec.from_dict({"command": ["true"]}).to_json()
    now = dt.datetime.now(dt.UTC)
    rows = [{"id": str(uuid.uuid4()), "client_job_id": None, "name": None,
             "state": JobState.QUEUED.value, "spec_json": spec, "context_key": "contexts/x.tar",
             "context_sha256": "0" * 64, "attempt": 0, "max_attempts": 3, "drained": 0,
             "gpus_needed": 0, "created_at": now + dt.timedelta(microseconds=i),
             "updated_at": now} for i in range(count)]
    with engine.begin() as conn:
        for i in range(0, count, 5000):
            conn.execute(insert(Job), rows[i:i + 5000])
    if engine.dialect.name == "sqlite":
        # Set-up, not measurement: fold the seeded rows into the database file now, so that
        # no timed commit pays for checkpointing them.
        raw = engine.raw_connection()  # outside any transaction
        try:
            raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # type: ignore[union-attr]
        finally:
            raw.close()


# (machine id, its private key as 64 hex digits): approved machines, as if joined.
Creds = list[tuple[str, str]]


def seed_machines(engine: Engine, count: int) -> Creds:
    now = dt.datetime.now(dt.UTC)
    made = [(str(uuid.uuid4()), keys.Ed25519PrivateKey.generate()) for _ in range(count)]
    with engine.begin() as conn:
        conn.execute(insert(Machine), [
            {"id": m, "name": f"bench-{i}", "public_key": keys.public_text(k),
             "fingerprint": keys.key_fingerprint(k), "status": "approved", "address": "",
             "capabilities_json": "{}", "gpus_json": "{}", "registered_at": now,
             "last_seen_at": now} for i, (m, k) in enumerate(made)])
    return [(m, k.private_bytes_raw().hex()) for m, k in made]


@functools.cache
def _key(private_hex: str) -> keys.Ed25519PrivateKey:
    return keys.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_hex))


def _signed(stub_call, request, method: str, cred: tuple[str, str], **kw):
    """One call as the machine `cred`, signed as its agent signs (agent.client), with its key
    loaded once, as an agent holds its own."""
    key = _key(cred[1])
    md = [(MACHINE_HEADER, cred[0]),
          *signed_metadata(key, method, request.SerializeToString(), cred[0])]
    return stub_call(request, metadata=md, **kw)


def _stub(address: str, pem: str) -> tuple[grpc.Channel, pb_grpc.AgentServiceStub]:
    channel = pinned_channel(address, pem)
    return channel, pb_grpc.AgentServiceStub(channel)


def join(address: str, pem: str, creds: Creds) -> None:
    """What every agent does when it starts, and every 10 s after: a heartbeat with its
    capabilities (untimed)."""
    channel, stub = _stub(address, pem)
    caps = pb.Capabilities(runtime="runsc", builder="buildah", cpus=8, memory_mb=32_000,
                           speed_gflops=100.0)

    def beat(cred: tuple[str, str]) -> None:
        _signed(stub.Heartbeat, pb.HeartbeatRequest(capabilities=caps), HEARTBEAT, cred,
                timeout=30)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(beat, creds))
    channel.close()


def measure(addresses: list[str], pem: str, creds: Creds, leases: int, threads: int,
            processes: int, servers: list[int] | None = None) -> dict[str, float]:
    """Latency from one client asking in turn (as gpumesh's driver does); throughput from
    `processes` client processes of `threads` threads each, all at once (agents are other
    processes on other machines: client work must not share the coordinator's GIL), spread
    over the coordinator processes at `addresses` (their pids: `servers`, else this one)."""
    alone = _client(addresses[0], pem, creds, leases // 3, 1)
    host_before = host_ms()
    per_process = max(1, leases // processes)
    servers = servers or [os.getpid()]
    procs = [subprocess.Popen([sys.executable, __file__, "--client", addresses[i % len(addresses)],
                               "--leases", str(per_process), "--threads", str(threads)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(processes)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(json.dumps({"pem": pem, "creds": creds}) + "\n")
        p.stdin.flush()
    for p in procs:  # each has warmed up and waits for "go"
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
    started, cpu0 = time.perf_counter(), sum(map(_cpu, servers))
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    busy: list[float] = []
    clients_cpu = 0.0
    for p in procs:
        assert p.stdout is not None
        report = json.loads(p.stdout.readline())
        busy += report["latencies"]
        clients_cpu += report["cpu_s"]
    wall = time.perf_counter() - started
    server_cpu = sum(map(_cpu, servers)) - cpu0
    for p in procs:
        p.wait(timeout=600)
    busy.sort()
    return {"median_ms": alone["median_ms"], "p95_ms": alone["p95_ms"],
            "per_s": len(busy) / wall, "busy_p95_ms": busy[int(len(busy) * 0.95) - 1] * 1000,
            "server_cpu_ms": server_cpu / len(busy) * 1000,
            "client_cpu_ms": clients_cpu / len(busy) * 1000,
            "host_ms": (host_before + host_ms()) / 2}


def at_best_speed(rows: list[dict[str, float]]) -> None:
    """Each row's server CPU per lease as it would be at the run's fastest host reading."""
    best = min(r["host_ms"] for r in rows)
    for r in rows:
        r["server_cpu_best_ms"] = r["server_cpu_ms"] * best / r["host_ms"]


def host_ms() -> float:
    """CPU milliseconds of a fixed pure-Python loop: the host's speed right now (lower is
    faster); the best of three, so a single preemption does not count."""
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        total = 0
        for i in range(1_000_000):
            total += i * i
        best = min(best, time.process_time() - t)
    return best * 1000


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(address: str, pem: str, creds: Creds, leases: int, threads: int,
            go: threading.Event | None = None) -> dict[str, float]:
    """Leases from `threads` threads over one channel, as random registered machines."""
    channel, stub = _stub(address, pem)
    latencies: list[float] = []
    lock = threading.Lock()
    rng = random.Random(os.getpid())

    def one(_: int) -> None:
        with lock:
            cred = rng.choice(creds)
        t = time.perf_counter()  # the agent's signing counts: it is part of every call
        reply = _signed(stub.Lease, pb.LeaseRequest(), LEASE, cred, timeout=30)
        took = time.perf_counter() - t
        assert reply.has_task
        with lock:
            latencies.append(took)

    for _ in range(20):  # warm-up: connection, caches, authentication of a few machines
        one(0)
    latencies.clear()
    if go is not None:
        go.wait()
    started, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(leases)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    channel.close()
    latencies.sort()
    return {"median_ms": statistics.median(latencies) * 1000,
            "p95_ms": latencies[int(len(latencies) * 0.95) - 1] * 1000, "per_s": leases / wall,
            "latencies": latencies, "cpu_s": cpu}  # type: ignore[dict-item]


def client_process(address: str, leases: int, threads: int) -> None:
    given = json.loads(sys.stdin.readline())
    pem, creds = given["pem"], [tuple(c) for c in given["creds"]]
    go = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        result.update(_client(address, pem, creds, leases, threads, go))  # type: ignore[arg-type]

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(1.0)  # let it warm up
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    worker.join()
    print(json.dumps({"latencies": result["latencies"], "cpu_s": result["cpu_s"]}), flush=True)


def floor(pem_files: tuple[Path, Path], reply: pb.LeaseReply, creds: Creds, leases: int,
          threads: int, processes: int) -> dict[str, float]:
    """The same clients' same signed Lease calls answered by a server that does nothing but
    hand back a lease reply made earlier: what gRPC, TLS and protobuf cost on this machine
    (the ceiling any coordinator written on grpcio's Python server can reach here)."""
    answer = reply.SerializeToString()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("campugrid.v1.AgentService", {
        "Lease": grpc.unary_unary_rpc_method_handler(lambda request, context: answer)})])
    cert, key = (f.read_bytes() for f in pem_files)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    srv.start()
    try:
        return measure([f"127.0.0.1:{port}"], cert.decode(), creds, leases, threads, processes)
    finally:
        srv.stop(grace=1).wait()


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
    ap.add_argument("--leases", type=int, default=600, help="leases per row")
    ap.add_argument("--threads", type=int, default=4, help="threads per client process")
    ap.add_argument("--processes", type=int, default=4, help="client processes at once")
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="queue depths")
    ap.add_argument("--machines", default=",".join(map(str, MACHINES)), help="machine counts")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--coordinators", default="1,2,4",
                    help="coordinator process counts on PostgreSQL (0: no such table)")
    ap.add_argument("--cluster-depths", default="1000,100000",
                    help="queue depths for the PostgreSQL table (100 machines)")
    args = ap.parse_args()
    if args.client:
        client_process(args.client, args.leases, args.threads)
        return
    root = Path(tempfile.mkdtemp(prefix="campugrid-sched-"))
    s3 = EmbeddedS3(root / "s3", "bench", uuid.uuid4().hex).start()
    settings = Settings.from_env(root / "coord", s3_endpoint=s3.endpoint, s3_access_key="bench",
                                 s3_secret_key=s3.secret_key, http_port=free_port(),
                                 grpc_port=free_port(), lease_seconds=600,
                                 admin_identity=root / "admin.json",
                                 **({"database_url": args.database_url} if args.database_url else {}))
    running = server.start(settings)
    address = f"127.0.0.1:{running.grpc_port}"
    pem = running.certificate.pem.decode()
    rows = []
    try:
        depths = [int(x) for x in args.depths.split(",")]
        counts = [int(x) for x in args.machines.split(",")]
        creds = seed_machines(running.coord.store.engine, max(counts))
        seeded = 0
        for depth in depths:
            seed_jobs(running.coord.store.engine, depth - seeded + 2 * args.leases * len(counts)
                      + 30 * (args.processes + 1) * len(counts))
            seeded = depth
            for machines in counts:
                join(address, pem, creds[:machines])  # agents heartbeat every 10 s: still here
                r = measure([address], pem, creds[:machines], args.leases, args.threads, args.processes)
                rows.append((depth, machines, r))
                print(f"  measured {depth} queued, {machines} machines: {r['median_ms']:.2f} ms",
                      file=sys.stderr)
        channel, stub = _stub(address, pem)
        sample = _signed(stub.Lease, pb.LeaseRequest(), LEASE, creds[0], timeout=30)
        channel.close()
        cert = running.certificate
        nothing = floor((cert.cert_file, cert.key_file), sample, creds[:max(counts)], args.leases,
                        args.threads, args.processes)
    finally:
        running.stop()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    peers = {} if args.no_peer else {d: peer(min(d, 50_000)) for d in depths}
    at_best_speed([r for _, _, r in rows] + [nothing])
    db = "PostgreSQL" if args.database_url else "SQLite"
    print(f"\nlease over gRPC on loopback, {db}: latency from one client asking in turn; "
          f"leases/s from {args.processes} client processes x {args.threads} threads at once "
          f"({args.leases} leases per row)\n")
    print("| queued  | machines | median ms | p95 ms | leases/s | p95 ms busy | CPU ms/lease server+clients "
          "| server at best speed | host ms | gpumesh median ms (queued) | ratio |")
    print("|---------|----------|-----------|--------|----------|-------------|----------------------------"
          "|----------------------|---------|----------------------------|-------|")
    for depth, machines, r in rows:
        p = peers.get(depth)
        pm = f"{p['median_ms']:.2f} ({p['queued']})" if p else "n/a"
        ratio = f"{p['median_ms'] / r['median_ms']:.1f}x" if p else "n/a"
        print(f"| {depth:>7} | {machines:>8} | {_lease_cells(r)} | {pm:>26} | {ratio:>5} |")
    print(f"| floor: a server that does nothing | {_lease_cells(nothing)} | {'':>26} | {'':>5} |")
    print("\nratio: gpumesh's median lease latency over ours, same machine, same run "
          "(higher is better for campugrid)")
    print("floor: the same clients' same signed Lease calls, answered with a lease reply made "
          "earlier by a grpcio server with no other work: gRPC, TLS and protobuf on this machine")
    counts = [int(x) for x in args.coordinators.split(",") if int(x) > 0]
    if counts:
        cluster_table(rows, nothing, counts, [int(x) for x in args.cluster_depths.split(",")], args)


def cluster_table(single: list[tuple[int, int, dict[str, float]]], nothing: dict[str, float],
                  counts: list[int], depths: list[int], args: argparse.Namespace) -> None:
    """N coordinator processes on one PostgreSQL, beside the SQLite process's row."""
    machines = 100
    root = Path(tempfile.mkdtemp(prefix="campugrid-cluster-"))
    os.chmod(root, 0o711)
    pg = TempPostgres(root / "pg").start()
    s3 = EmbeddedS3(root / "s3", "bench", uuid.uuid4().hex).start()
    results: list[tuple[int, int, dict[str, float]]] = []
    try:
        for n in counts:
            url = _fresh_database(pg, f"cluster_{n}")
            engine = make_engine(url)
            migrate(engine)
            creds = seed_machines(engine, machines)
            procs, addresses = _coordinators(root / f"state-{n}", url, s3, n)
            try:
                pem = (root / f"state-{n}" / "tls" / "coordinator.crt").read_text()
                join(addresses[0], pem, creds)
                seeded = 0
                for depth in depths:
                    seed_jobs(engine, depth - seeded + 2 * args.leases + 30 * (args.processes + 1))
                    seeded = depth
                    r = measure(addresses, pem, creds, args.leases, args.threads, args.processes,
                                [p.pid for p in procs])
                    results.append((n, depth, r))
                    print(f"  measured {n} coordinators on PostgreSQL, {depth} queued: "
                          f"{r['per_s']:.0f} leases/s", file=sys.stderr)
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(timeout=30)
                engine.dispose()
    finally:
        s3.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ncoordinator processes on one PostgreSQL ({machines} machines; {args.processes} client "
          f"processes x {args.threads} threads spread over them), beside one SQLite process\n")
    at_best_speed([r for _, _, r in single] + [r for _, _, r in results] + [nothing])
    print("| database   | processes | queued  | median ms | p95 ms | leases/s | p95 ms busy | server CPU ms/lease "
          "| at best speed | host ms |")
    print("|------------|-----------|---------|-----------|--------|----------|-------------|---------------------"
          "|---------------|---------|")
    for depth in depths:
        for d, m, r in single:
            if d == depth and m == machines:
                print(f"| SQLite     | {1:>9} | {depth:>7} | {_cluster_cells(r)} |")
        for n, d, r in results:
            if d == depth:
                print(f"| PostgreSQL | {n:>9} | {depth:>7} | {_cluster_cells(r)} |")
    print(f"| floor      | {'':>9} | {'':>7} | {_cluster_cells(nothing)} |")
    print("\nserver CPU: all coordinator processes together (PostgreSQL's own not counted); "
          "floor: as in the first table")


def _lease_cells(r: dict[str, float]) -> str:
    """A row's measured cells in the first table."""
    return (f"{r['median_ms']:9.2f} | {r['p95_ms']:6.2f} | {r['per_s']:8.0f} | {r['busy_p95_ms']:11.2f} "
            f"| {r['server_cpu_ms']:12.2f} + {r['client_cpu_ms']:<12.2f} "
            f"| {r['server_cpu_best_ms']:20.2f} | {r['host_ms']:7.0f}")


def _cluster_cells(r: dict[str, float]) -> str:
    """A row's measured cells in the coordinator-processes table."""
    return (f"{r['median_ms']:9.2f} | {r['p95_ms']:6.2f} | {r['per_s']:8.0f} | {r['busy_p95_ms']:11.2f} "
            f"| {r['server_cpu_ms']:19.2f} | {r['server_cpu_best_ms']:13.2f} | {r['host_ms']:7.0f}")


def _fresh_database(pg: TempPostgres, name: str) -> str:
    admin = create_engine(pg.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return pg.url.rsplit("/", 1)[0] + f"/{name}"


def _coordinators(state: Path, url: str, s3: EmbeddedS3, n: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """`campugrid coordinator serve` n times on one state folder (one certificate); the first
    makes the certificate before the others start."""
    env = {**os.environ, "CAMPUGRID_DATABASE_URL": url, "CAMPUGRID_S3_ENDPOINT": s3.endpoint,
           "CAMPUGRID_S3_ACCESS_KEY": s3.access_key, "CAMPUGRID_S3_SECRET_KEY": s3.secret_key}
    procs, addresses = [], []
    for _ in range(n):
        grpc_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "campugrid.cli", "coordinator", "serve", "--state-dir", str(state),
             "--http-port", str(free_port()), "--grpc-port", str(grpc_port), "--lease-seconds", "600",
             "--admin-identity", str(state.parent / f"admin-{n}.json")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        addresses.append(f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + 60
        while not _listening(grpc_port):
            assert time.monotonic() < deadline and procs[-1].poll() is None, "a coordinator did not start"
            time.sleep(0.1)
    return procs, addresses


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
