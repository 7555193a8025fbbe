"""What an idle fleet on streams costs one coordinator process, how fast it joins and comes
back after a restart, and how fast new work reaches it.

    .venv/bin/python bench/fleet.py [--agents 1000,10000] [--simulators 0] [--seconds 20]
                                    [--submits 20] [--burst 200] [--restart-at 10000]

For each fleet size, one `campugrid coordinator serve` process (SQLite, an embedded S3
server) gets that many approved machines, and simulator processes (bench/fleet_agents.py:
thousands of agents each, --simulators, by default one per AGENTS_PER_SIMULATOR agents)
connect them as an idle agent does, each on its own TLS connection and stream.

Measured for each size, in this order, on the one coordinator process:

- join: from the simulators' start (each agent starts at a random moment in its first
  HEARTBEAT_S) to the coordinator's /metrics gauges campugrid_fleet_connected and
  campugrid_fleet_ready counting every agent; the join rate, and the CPU each join cost the
  coordinator and the simulators.
- idle, over --seconds once every agent has joined: the coordinator's CPU (its process,
  /proc), the statements it sent to the database (campugrid_db_statements_total, less what
  the scrapes cost) beside the same with no agent connected (measured first: its lease
  reaper's), the TCP connections open to its gRPC port, and its resident memory less what it
  held before the agents came (per agent).
- dispatch: --submits jobs submitted one at a time through REST, each one's dispatch the time
  from its record's created_at (stored before the answer) to the moment an agent has its
  lease.
- burst: --burst jobs queued at once (written to the database as bench/scheduler.py seeds
  them; SQLite tells no process of another's writes, so one more job submitted through REST
  then wakes the dispatcher), and the leases/s from that submit to the last lease an agent
  received; beside it, unary Lease calls' leases/s (bench/scheduler.py's measurement, on a
  coordinator process of its own with 100 machines, run first in the same run).
- restart (the sizes in --restart-at): the coordinator SIGKILLed with every agent connected
  and ready, started again on the same ports, state folder and database, and the time until
  its gauges count every agent connected and ready again, the database statements/s
  meanwhile (the peak over 1 s windows), the streams the agents tried per agent, and one
  job's dispatch once they are all back (placeable again).

History: idle agents used to poll, with a held Lease call every second; 1,000 polling agents
(held Lease every second), measured 2026-12-06 on this machine: 1.08 cores, 1,355 DB
statements/s, dispatch p95 311 ms, 126 KB/agent; the same 1,000 on streams: 0.04 cores, 2.8
statements/s (the reaper's own), p95 15 ms, 106 KB.

The simulators share the machine's two cores with the coordinator: the coordinator's CPU is
its own process's, whatever the simulators cost, but its joins and dispatches wait for the
cores the simulators hold meanwhile, and for the simulated agents' own side of each join.
They stand for machines elsewhere, so they run at a lower priority (--simulator-nice, 10 by
default): a coordinator starved by them is not what its own host would see (at the same
priority, a restart of 10,000 had the new process take 11 s to listen, not 1.3 s, while the
agents' tries at its closed port held both cores, and its first joins waited as long).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, tar_folder
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.models import Job
from campugrid.protocol.identities import Identity
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
# The simulated agents (bench/fleet_agents.py), the coordinator processes and what is read
# of them (bench/fleet_coordinators.py), its tables (bench/fleet_report.py), gRPC's own cost
# per stream (bench/grpc_floor.py)
# and the same helpers as bench/scheduler.py:
# scripts beside this one, not packages mypy knows of (what they give is typed where used).
from fleet_agents import Simulators  # type: ignore[import-not-found]  # noqa: E402
from fleet_coordinators import (  # type: ignore[import-not-found]  # noqa: E402
    Coordinator,
    Scraper,
    rows_written,
    rss_bytes,
    tcp_connections,
    wait_fleet,
)
from fleet_report import (  # type: ignore[import-not-found]  # noqa: E402
    HEARTBEAT_S,
    UNARY_LEASES,
    UNARY_MACHINES,
    UNARY_PROCESSES,
    UNARY_THREADS,
    report,
    report_clusters,
)
from grpc_floor import Floor  # type: ignore[import-not-found]  # noqa: E402
from scheduler import (  # type: ignore[import-not-found]  # noqa: E402
    _cpu,
    _fresh_database,
    _listening,
    join,
    measure,
    seed_jobs,
    seed_machines,
)

from tests.support.postgres import TempPostgres  # noqa: E402  (scheduler put the repository on the path)

AGENTS_PER_SIMULATOR = 2500  # --simulators' default: one simulator process per this many
PGSTAT_S = 11.0  # PostgreSQL's backends report their counts at least this often, idle or not
FILES = 262_144  # open files a process may have, where this one may raise its limit
RESTART_GIVE_UP_S = 180.0  # the goal is 30 s: past this, the restart row says how far it got


def row(agents: int, args: argparse.Namespace, root: Path, s3: EmbeddedS3) -> dict[str, Any]:
    """One fleet size: join, idle, dispatch, burst and (where asked) restart."""
    state = root / f"stream-{agents}" / "state"  # its admin identity beside it, its own
    state.parent.mkdir()
    url = f"sqlite:///{state.parent / 'fleet.db'}"
    engine = make_engine(url)
    migrate(engine)
    creds: list[tuple[str, str]] = seed_machines(engine, agents)
    coordinator = Coordinator(state, url, s3)
    coordinator.start()
    sims = None
    try:
        pem = (state / "tls" / "coordinator.crt").read_text()
        identity = state.parent / "admin.json"
        while not identity.exists():  # made once the process is up
            time.sleep(0.2)
        api = Api(coordinator.rest, Identity.load(identity))
        scraper = Scraper(coordinator.rest, api.mint_scrape_token(f"fleet-{agents}")["token"])
        rss_before = rss_bytes(coordinator.pid)
        # What the coordinator sends the database with no agent at all (its lease reaper):
        # the fleet's own share is what comes on top.
        b0, t_b = scraper.read(), time.monotonic()
        time.sleep(min(args.seconds, 10.0))
        b1, wall_b = scraper.read(), time.monotonic() - t_b
        baseline = (b1["statements"] - b0["statements"] - scraper.own) / wall_b
        baseline_q = (b1["queries"] - b0["queries"] - scraper.own_queries) / wall_b

        # Join: the simulators' start is the clock's. Each agent starts at a random moment
        # in the first HEARTBEAT_S, or where that would be more than --join-rate agents a
        # second, over as long as that rate takes: offered faster than the coordinator takes
        # them, opening streams pile up, time out and are tried again, each try a connection
        # the coordinator holds (10,000 started over 10 s ran it out of its 20,000 file
        # descriptors on this machine, 2026-12-06, 196 of them ready), so that the join
        # would measure that collapse, not the joins. The restart row offers them all at once.
        processes = args.simulators or math.ceil(agents / AGENTS_PER_SIMULATOR)
        start_s = max(HEARTBEAT_S, agents / args.join_rate)
        j_cpu, j_statements = _cpu(coordinator.pid), scraper.statements()
        sims = Simulators(coordinator.address, pem, creds, processes, start_s, args.simulator_nice)
        join_s = wait_fleet([scraper], agents, timeout=start_s + 120)
        j_cpu = _cpu(coordinator.pid) - j_cpu
        j_statements = scraper.statements() - j_statements - scraper.own
        sims_cpu = sims.cpu()  # they did nothing but join so far
        joined = sims.counts()

        # Idle: every agent in its rhythm first.
        time.sleep(HEARTBEAT_S)
        c0, m0, n0, t0 = _cpu(coordinator.pid), scraper.read(), sims.counts(), time.monotonic()
        time.sleep(args.seconds)
        c1, m1, n1, t1 = _cpu(coordinator.pid), scraper.read(), sims.counts(), time.monotonic()
        s0, s1 = m0["statements"], m1["statements"]
        rss, connections = rss_bytes(coordinator.pid), tcp_connections(coordinator.grpc_port)
        wall = t1 - t0

        spec = JobSpec.from_dict({"command": ["true"]})
        context = tar_folder(_hello(root))
        dispatch = sims.dispatches(api, context, spec, args.submits)
        full_gcs = scraper.read()["full_gcs"] - m0["full_gcs"]  # idle and dispatching

        result: dict[str, Any] = {
            "agents": agents, "simulators": processes, "join_s": join_s, "start_s": start_s,
            "join_cpu_ms": j_cpu / agents * 1000, "sims_cpu_ms": sims_cpu / agents * 1000,
            "join_statements": j_statements / agents, "join_opens": joined["opens"] / agents,
            "cpu": (c1 - c0) / wall, "statements_per_s": (s1 - s0 - scraper.own) / wall,
            "baseline_per_s": baseline, "queries_per_s": (m1["queries"] - m0["queries"] - scraper.own_queries) / wall,
            "baseline_queries_per_s": baseline_q, "beats_per_s": (n1["beats"] - n0["beats"]) / wall,
            "ended": n1["ended"] - n0["ended"] + n1["failed"] - n0["failed"], "codes": n1["codes"],
            "connections": connections, "full_gcs": full_gcs,
            "dispatch_p50_ms": statistics.median(dispatch) * 1000,
            "dispatch_p95_ms": _p95(dispatch) * 1000,
            "kb_per_agent": max(0, rss - rss_before) / agents / 1024}
        if args.burst:
            result["burst"] = burst(engine, api, sims, coordinator, scraper, args.burst, context, spec)
        if agents in args.restart_at:
            result["restart"] = restart(coordinator, scraper, sims, api, agents, context, spec)
        result["codes"] = sims.counts()["codes"]
        return result
    finally:
        if sims is not None:
            sims.stop()
        coordinator.stop()
        engine.dispose()


def cluster_row(agents: int, processes: int, args: argparse.Namespace, root: Path,
                s3: EmbeddedS3, pg: TempPostgres) -> dict[str, Any]:
    """`processes` coordinator processes on one PostgreSQL (one state folder, so one
    certificate), the agents dealt evenly over them: each process's CPU, queries and memory
    per agent, the fleet's queries together, and the dispatch of jobs submitted through the
    first process to agents connected anywhere (PostgreSQL's LISTEN/NOTIFY tells the others)."""
    state = root / f"pg-{agents}x{processes}" / "state"
    state.parent.mkdir()
    os.chmod(state.parent, 0o711)
    url = _fresh_database(pg, f"fleet_{agents}_{processes}")
    engine = make_engine(url)
    migrate(engine)
    creds: list[tuple[str, str]] = seed_machines(engine, agents)
    coordinators = [Coordinator(state, url, s3, name=f"coordinator-{i}") for i in range(processes)]
    sims = None
    try:
        for c in coordinators:  # the first makes the certificate and the admin, then the rest
            c.start()
            identity = state.parent / "admin.json"
            while not identity.exists() or not _listening(c.http_port):  # REST comes after gRPC
                time.sleep(0.2)
        pem = (state / "tls" / "coordinator.crt").read_text()
        api = Api(coordinators[0].rest, Identity.load(state.parent / "admin.json"))
        token = api.mint_scrape_token(f"fleet-pg-{agents}")["token"]
        scrapers = [Scraper(c.rest, token) for c in coordinators]
        rss_before = [rss_bytes(c.pid) for c in coordinators]
        b0, t_b = [x.read() for x in scrapers], time.monotonic()
        time.sleep(min(args.seconds, 10.0))
        b1, wall_b = [x.read() for x in scrapers], time.monotonic() - t_b
        baseline_q = [(b["queries"] - a["queries"] - x.own_queries) / wall_b
                      for a, b, x in zip(b0, b1, scrapers, strict=True)]

        # One simulator process per AGENTS_PER_SIMULATOR, at least one per coordinator:
        # simulator i's agents are creds[i::n] and connect to coordinator i modulo processes.
        n = processes * max(1, math.ceil(agents / processes / AGENTS_PER_SIMULATOR))
        start_s = max(HEARTBEAT_S, agents / args.join_rate)
        sims = Simulators([c.address for c in coordinators], pem, creds, n, start_s,
                          args.simulator_nice)
        join_s = wait_fleet(scrapers, agents, timeout=start_s + 180)

        time.sleep(max(HEARTBEAT_S, PGSTAT_S))  # the join's own writes counted before the window
        w0, tw0 = rows_written(engine), time.monotonic()
        c0, m0, t0 = [_cpu(c.pid) for c in coordinators], [x.read() for x in scrapers], time.monotonic()
        n0 = sims.counts()
        time.sleep(args.seconds)
        c1, m1, t1 = [_cpu(c.pid) for c in coordinators], [x.read() for x in scrapers], time.monotonic()
        time.sleep(PGSTAT_S)  # what the backends counted in the window, flushed
        w1, tw1 = rows_written(engine), time.monotonic()
        n1 = sims.counts()
        wall = t1 - t0
        shares = [m["connected"] for m in m1]
        rss = [rss_bytes(c.pid) for c in coordinators]
        cpu = [(b - a) / wall for a, b in zip(c0, c1, strict=True)]
        queries = [(b["queries"] - a["queries"] - x.own_queries) / wall
                   for a, b, x in zip(m0, m1, scrapers, strict=True)]

        dispatch = sims.dispatches(api, tar_folder(_hello(root)),
                               JobSpec.from_dict({"command": ["true"]}), args.submits)
        return {"agents": agents, "processes": processes, "simulators": n, "join_s": join_s,
                "start_s": start_s, "shares": shares, "cpu": cpu, "queries": queries,
                "baseline_queries": baseline_q,
                "kb_per_agent": [max(0, r - b) / max(1.0, k) / 1024
                                 for r, b, k in zip(rss, rss_before, shares, strict=True)],
                "beats_per_s": (n1["beats"] - n0["beats"]) / wall, "rows_per_s": (w1 - w0) / (tw1 - tw0),
                "ended": n1["ended"] - n0["ended"] + n1["failed"] - n0["failed"],
                "dispatch_p50_ms": statistics.median(dispatch) * 1000,
                "dispatch_p95_ms": _p95(dispatch) * 1000, "codes": sims.counts()["codes"]}
    finally:
        if sims is not None:
            sims.stop()
        for c in coordinators:
            c.stop()
        engine.dispose()


def _p95(sorted_values: list[float]) -> float:
    return sorted_values[max(0, math.ceil(len(sorted_values) * 0.95) - 1)]


def burst(engine: Any, api: Api, sims: Simulators, coordinator: Coordinator, scraper: Scraper,
          count: int, context: bytes, spec: JobSpec) -> dict[str, float]:
    """`count` jobs queued at once, and one more submitted through REST that wakes the
    dispatcher (on SQLite no process hears of another's writes: without it, the dispatcher
    would find them at its next look, up to fleet.RECHECK_S later). Leases/s: all of them,
    from the submit stored to the last lease received."""
    seed_jobs(engine, count)
    seeded = time.time()
    with engine.connect() as conn:  # every queued job is one of these: the earlier ones ran
        jobs = set(conn.scalars(select(Job.id).where(Job.state == JobState.QUEUED.value)))
    c0, s0 = _cpu(coordinator.pid), scraper.statements()
    waker = api.submit(context, spec)
    woken = dt.datetime.fromisoformat(waker["created_at"]).timestamp()
    leased = sims.wait_leased(jobs | {waker["id"]}, timeout=120)
    cpu, statements = _cpu(coordinator.pid) - c0, scraper.statements() - s0 - scraper.own
    first, last = min(leased.values()), max(leased.values())
    # Had the dispatcher's own look come first, the clock starts when the jobs were queued.
    start = woken if first >= woken else seeded
    return {"jobs": len(leased), "per_s": len(leased) / (last - start),
            "first_ms": (first - start) * 1000, "cpu_ms": cpu / len(leased) * 1000,
            "statements": statements / len(leased)}


def restart(coordinator: Coordinator, scraper: Scraper, sims: Simulators, api: Api, agents: int,
            context: bytes, spec: JobSpec) -> dict[str, Any]:
    """SIGKILL with every agent connected and ready, the same process started again, and
    the agents' way back read from its gauges every half second."""
    wait_fleet([scraper], agents, timeout=60)
    before = sims.counts()
    killed = time.monotonic()
    coordinator.kill()
    coordinator.start()
    listening = time.monotonic() - killed
    samples: list[tuple[float, float, float, float]] = []  # (when, statements, connected, ready)
    connected_s = ready_s = float("nan")
    deadline = killed + RESTART_GIVE_UP_S
    while time.monotonic() < deadline:
        try:
            g = scraper.read()
        except (httpx.HTTPError, KeyError):  # its REST server comes up just after gRPC
            time.sleep(0.1)
            continue
        now = time.monotonic() - killed
        if not samples or now // 10 > samples[-1][0] // 10:  # minutes of it: show it coming
            print(f"    restart + {now:.0f} s: {g['connected']:.0f} connected, "
                  f"{g['ready']:.0f} ready", file=sys.stderr)
        samples.append((now, g["statements"], g["connected"], g["ready"]))
        if math.isnan(connected_s) and g["connected"] >= agents:
            connected_s = now
        if math.isnan(ready_s) and g["ready"] >= agents and g["connected"] >= agents:
            ready_s = now
            break
        time.sleep(0.5)
    after = sims.counts()
    peak = 0.0  # the statements/s of the busiest 1 s window (scrapes' own taken off)
    for i, (t, s, _, _) in enumerate(samples):
        for j in range(i + 1, len(samples)):
            if samples[j][0] - t >= 1.0:
                peak = max(peak, (samples[j][1] - s - (j - i) * scraper.own) / (samples[j][0] - t))
                break
    (t_first, s_first, _, _), (t_last, s_last, c_last, r_last) = samples[0], samples[-1]
    mean = (s_last - s_first - (len(samples) - 1) * scraper.own) / max(1e-9, t_last - t_first)
    result = {"listening_s": listening, "connected_s": connected_s, "ready_s": ready_s,
              "connected": c_last, "ready": r_last, "peak_per_s": peak, "mean_per_s": mean,
              "opens": (after["opens"] - before["opens"]) / agents,
              "failed": after["failed"] - before["failed"], "dispatch_ms": float("nan")}
    if not math.isnan(ready_s):
        result["dispatch_ms"] = sims.dispatch(api, context, spec) * 1000
    return result


def unary(root: Path, s3: EmbeddedS3) -> dict[str, float]:
    """bench/scheduler.py's throughput of unary Lease calls (client processes of threads,
    each call a claim), on a coordinator process of its own with UNARY_MACHINES machines and
    as many queued jobs as the measurement takes (none left over)."""
    state = root / "unary" / "state"
    state.parent.mkdir()
    url = f"sqlite:///{state.parent / 'fleet.db'}"
    engine = make_engine(url)
    migrate(engine)
    creds = seed_machines(engine, UNARY_MACHINES)
    # What measure() takes: a client alone (20 to warm up, a third of the leases), then each
    # process's 20 to warm up and its share.
    seed_jobs(engine, 20 + UNARY_LEASES // 3
              + UNARY_PROCESSES * (20 + UNARY_LEASES // UNARY_PROCESSES))
    engine.dispose()
    coordinator = Coordinator(state, url, s3)
    coordinator.start()
    try:
        pem = (state / "tls" / "coordinator.crt").read_text()
        join(coordinator.address, pem, creds)
        r: dict[str, float] = measure([coordinator.address], pem, creds, UNARY_LEASES,
                                      UNARY_THREADS, UNARY_PROCESSES, [coordinator.pid])
        return r
    finally:
        coordinator.stop()


def _hello(root: Path) -> Path:
    folder = root / "context"
    if not folder.exists():
        folder.mkdir()
        (folder / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--agents", default="1000,10000", help="fleet sizes, one row each")
    ap.add_argument("--simulators", type=int, default=0,
                    help=f"simulator processes (0: one per {AGENTS_PER_SIMULATOR} agents)")
    ap.add_argument("--join-rate", type=float, default=100.0,
                    help="agents started per second at most (the first 10 s's at least)")
    ap.add_argument("--seconds", type=float, default=20.0, help="the idle window of each row")
    ap.add_argument("--submits", type=int, default=20, help="jobs submitted for dispatch times")
    ap.add_argument("--burst", type=int, default=200, help="jobs queued at once (0: none)")
    ap.add_argument("--restart-at", default=None,
                    help="fleet sizes whose coordinator is killed and restarted (default: the "
                         "largest; 0: none)")
    ap.add_argument("--no-unary", action="store_true", help="skip the unary Lease row")
    ap.add_argument("--simulator-nice", type=int, default=10,
                    help="the simulators' niceness (0: the coordinator's own priority)")
    ap.add_argument("--postgres", default="10000x4",
                    help="AGENTSxPROCESSES rows on one PostgreSQL, comma-separated (0: none)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.agents.split(",")]
    clusters = [tuple(int(y) for y in x.split("x")) for x in args.postgres.split(",")
                if x.strip() not in ("", "0")]
    args.restart_at = {int(x) for x in (args.restart_at or str(max(sizes))).split(",")}
    # A socket per agent, on both sides, in processes that inherit this one's limit; root
    # may raise the hard limit too (a process of 20,000 agents needs more than Debian's).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, FILES), max(hard, FILES)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = Path(tempfile.mkdtemp(prefix="campugrid-fleet-"))
    os.chmod(root, 0o711)  # PostgreSQL's own user keeps its cluster in here
    s3 = EmbeddedS3(root / "s3", "bench", uuid.uuid4().hex).start()
    rows, unary_row, cluster_rows = [], None, []
    pg = None
    try:
        if args.burst and not args.no_unary:
            try:
                unary_row = unary(root, s3)
                print(f"  measured unary Lease: {unary_row['per_s']:.0f} leases/s", file=sys.stderr)
            except Exception as e:  # the unary path is not this bench's subject: say, go on
                print(f"  unary Lease not measured: {type(e).__name__}: {e}", file=sys.stderr)
        for n in sizes:
            rows.append(row(n, args, root, s3))
            print(f"  measured {n} idle agents", file=sys.stderr)
        args.floor = Floor.measure(max(sizes))  # gRPC's own, as many streams as the largest row
        if clusters:
            pg = TempPostgres(root / "pg").start()
        for n, k in clusters:
            assert pg is not None
            try:
                cluster_rows.append(cluster_row(n, k, args, root, s3, pg))
                print(f"  measured {n} idle agents over {k} processes on PostgreSQL", file=sys.stderr)
            except Exception as e:  # the rows measured so far are still reported
                print(f"  {n} agents over {k} processes not measured: {type(e).__name__}: {e}",
                      file=sys.stderr)
    finally:
        if pg is not None:
            pg.stop()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    report(rows, unary_row, args)
    report_clusters(cluster_rows, args)


if __name__ == "__main__":
    main()
