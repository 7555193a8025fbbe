"""What bench/fleet.py prints: its tables, what each column means, and the issue's goals beside
what was measured (met or MISSED). A script beside it, as its other helpers are."""

from __future__ import annotations

import argparse
import math
from typing import Any

from campugrid.agent.link import BACKOFF_MAX_S, BACKOFF_S

# What the bench measures with (bench/fleet.py), said in its tables:
HEARTBEAT_S = 10.0  # agent/worker.py's, when idle
UNARY_MACHINES, UNARY_LEASES, UNARY_THREADS, UNARY_PROCESSES = 100, 300, 4, 2

def report(rows: list[dict[str, Any]], unary_row: dict[str, float] | None,
           args: argparse.Namespace) -> None:
    print(f"\nidle agents on streams, one coordinator process (SQLite), {args.seconds:.0f} s "
          f"window; dispatch over {args.submits} submits, one at a time; simulators at nice "
          f"{args.simulator_nice}\n")
    print("| idle agents | simulators | started over s | join s (agents/s) "
          "| coordinator CPU ms/join (simulators') | DB statements/join | coordinator CPU (cores) | DB statements/s (none connected) | DB queries/s (none connected) | heartbeats/s "
          "| TCP connections | dispatch p50 ms | p95 ms | full GCs | coordinator KB/agent | streams lost |")
    print("|-------------|------------|----------------|-------------------"
          "|--------------------------------------|--------------------|-------------------------|----------------------------------|-------------------------------|--------------"
          "|-----------------|-----------------|--------|----------|----------------------|--------------|")
    for r in rows:
        joined = f"{r['join_s']:.1f} ({r['agents'] / r['join_s']:.0f})"
        join_cpu = f"{r['join_cpu_ms']:.2f} ({r['sims_cpu_ms']:.2f})"
        statements = f"{r['statements_per_s']:.1f} ({r['baseline_per_s']:.1f})"
        queries = f"{r['queries_per_s']:.1f} ({r['baseline_queries_per_s']:.1f})"
        print(f"| {r['agents']:>11} | {r['simulators']:>10} | {r['start_s']:14.0f} | {joined:>17} "
              f"| {join_cpu:>36} | {r['join_statements']:18.1f} | {r['cpu']:23.2f} | {statements:>32} "
              f"| {queries:>29} | {r['beats_per_s']:12.0f} "
              f"| {r['connections']:>15} | {r['dispatch_p50_ms']:15.1f} | {r['dispatch_p95_ms']:6.1f} "
              f"| {r['full_gcs']:8.0f} | {r['kb_per_agent']:20.1f} | {r['ended']:>12} |")
    print("\njoin: from the simulators' start (agents start at random over the time in 'started "
          f"over', {HEARTBEAT_S:.0f} s or agents / --join-rate {args.join_rate:.0f}) to the "
          "coordinator's gauges counting every agent connected and ready; CPU per join: the coordinator's, and the simulators' in brackets. Statements: "
          "what the coordinator sent to SQLite (BEGIN and PRAGMA included), idle, and in "
          "brackets with no agent connected (its lease reaper); queries: of those, what reads "
          "or writes rows. Full GCs: the coordinator's full garbage collections over the idle "
          "window and the dispatches (python_gc_collections_total, generation 2; each walks "
          "every object its streams hold). Streams lost: streams that "
          "ended or failed to open in the idle window.")
    for r in rows:
        if r["codes"]:
            print(f"streams ended or refused ({r['agents']} agents, whole row), by why: {r['codes']}")
    print(args.floor.sentence())

    bursts = [r for r in rows if "burst" in r]
    if bursts:
        print(f"\nleases under load: {args.burst} jobs queued at once, from the waking submit "
              "to the last lease an agent received\n")
        print("| path                         | agents | jobs | leases/s | first lease ms "
              "| coordinator CPU ms/lease | DB statements/lease |")
        print("|------------------------------|--------|------|----------|----------------"
              "|--------------------------|---------------------|")
        for r in bursts:
            b = r["burst"]
            print(f"| {'stream (dispatch rounds)':<28} | {r['agents']:>6} | {b['jobs']:>4.0f} "
                  f"| {b['per_s']:8.0f} | {b['first_ms']:14.1f} | {b['cpu_ms']:24.2f} "
                  f"| {b['statements']:19.1f} |")
        if unary_row is not None:
            path = f"unary Lease ({UNARY_PROCESSES}x{UNARY_THREADS} threads)"
            print(f"| {path:<28} | {UNARY_MACHINES:>6} | {UNARY_LEASES:>4} | {unary_row['per_s']:8.0f} "
                  f"| {unary_row['median_ms']:14.1f} | {unary_row['server_cpu_ms']:24.2f} | {'':>19} |")
        print("\nstream: one round claims for the idle agents in turn, each lease down its "
              "agent's stream, which says it is ready again at once; its coordinator CPU "
              "includes the waking REST submit. unary: bench/scheduler.py's measure() "
              f"({UNARY_PROCESSES} client processes x {UNARY_THREADS} threads asking at once, "
              f"{UNARY_MACHINES} machines, a coordinator process of its own, this run); its "
              "'first lease ms' is one client's median Lease latency"
              + ("" if unary_row is not None else "; unary not measured (see stderr)"))

    restarts = [r for r in rows if "restart" in r]
    if restarts:
        print("\ncoordinator SIGKILLed with every agent connected and ready, started again on "
              f"the same ports, state and database; agents back off {BACKOFF_S:.0f} s doubling "
              f"to {BACKOFF_MAX_S:.0f} s, jittered, while it cannot be reached; one it turns "
              "away (busy) comes back when it says\n")
        print("| agents | listening again s | all connected s | all ready s | DB statements/s "
              "peak 1 s (mean) | stream tries/agent | dispatch after ms |")
        print("|--------|-------------------|-----------------|-------------|-----------------"
              "----------------|--------------------|-------------------|")
        for r in restarts:
            x = r["restart"]
            statements = f"{x['peak_per_s']:.0f} ({x['mean_per_s']:.0f})"
            print(f"| {r['agents']:>6} | {x['listening_s']:17.1f} | {x['connected_s']:15.1f} "
                  f"| {x['ready_s']:11.1f} | {statements:>32} | {x['opens']:18.2f} "
                  f"| {x['dispatch_ms']:17.1f} |")
        for r in restarts:
            x = r["restart"]
            if math.isnan(x["ready_s"]):
                print(f"{r['agents']} agents: only {x['connected']:.0f} connected and "
                      f"{x['ready']:.0f} ready when the bench gave up")
        print("\ntimes from the SIGKILL; gauges read every 0.5 s (campugrid_fleet_connected, "
              "campugrid_fleet_ready); statements: the new process's, scrapes' own taken off; "
              "stream tries: every Connect an agent opened from the kill until all were back "
              "(1.00: each came back at its first try).")

    for r in rows:
        if r["agents"] < 10_000:
            continue
        checks = [("coordinator CPU <= 0.2 cores", r["cpu"] <= 0.2, f"{r['cpu']:.2f}"),
                  ("idle fleet's DB queries/s <= 1",
                   r["queries_per_s"] - r["baseline_queries_per_s"] <= 1,
                   f"{r['queries_per_s'] - r['baseline_queries_per_s']:.1f} over the baseline "
                   f"({r['statements_per_s'] - r['baseline_per_s']:.1f} statements with BEGIN and "
                   "PRAGMA)"),
                  ("dispatch p95 <= 50 ms", r["dispatch_p95_ms"] <= 50, f"{r['dispatch_p95_ms']:.1f}"),
                  ("memory < 50 KB/agent", r["kb_per_agent"] < 50,
                   f"{r['kb_per_agent']:.1f}, of which gRPC's own TLS stream "
                   f"{args.floor.tls_kb:.1f}")]
        if "restart" in r:
            ready_s = r["restart"]["ready_s"]
            checks.append(("all back and ready <= 30 s after a restart",
                           not math.isnan(ready_s) and ready_s <= 30, f"{ready_s:.1f} s"))
        _goals(f"{r['agents']} agents", checks)


def _goals(what: str, checks: list[tuple[str, bool, str]]) -> None:
    """Each goal (its name, whether met, what was measured) on one line."""
    print(f"\ngoals, {what}: " + "; ".join(
        f"{name}: {got} ({'met' if ok else 'MISSED'})" for name, ok, got in checks))


def _each(values: list[float], fmt: str) -> str:
    return " ".join(fmt.format(v) for v in values)


def report_clusters(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if not rows:
        return
    print(f"\nidle agents over several coordinator processes on one PostgreSQL, {args.seconds:.0f} s "
          f"window; dispatch over {args.submits} submits through the first process, one at a time\n")
    print("| idle agents | processes | agents/process | join s (agents/s) | coordinator CPU "
          "(cores, each process) | DB queries/s, each process (none connected) | DB queries/s, "
          "whole fleet | rows written/s | heartbeats/s | dispatch p50 ms | p95 ms | KB/agent, "
          "each process | streams lost |")
    print("|-------------|-----------|----------------|-------------------|----------------"
          "-----------------------|----------------------------------------------|---------------"
          "----------|----------------|--------------|-----------------|--------|-----------"
          "------------|--------------|")
    for r in rows:
        queries = (_each(r["queries"], "{:.1f}") + " ("
                   + _each(r["baseline_queries"], "{:.1f}") + ")")
        joined = f"{r['join_s']:.1f} ({r['agents'] / r['join_s']:.0f})"
        print(f"| {r['agents']:>11} | {r['processes']:>9} | {_each(r['shares'], '{:.0f}'):>14} "
              f"| {joined:>17} | {_each(r['cpu'], '{:.2f}'):>37} | {queries:>44} "
              f"| {sum(r['queries']):23.1f} | {r['rows_per_s']:14.0f} | {r['beats_per_s']:12.0f} "
              f"| {r['dispatch_p50_ms']:15.1f} | {r['dispatch_p95_ms']:6.1f} "
              f"| {_each(r['kb_per_agent'], '{:.0f}'):>21} | {r['ended']:>12} |")
    print("\nagents/process: what each process's gauge counted connected; queries: what each "
          "process sent PostgreSQL that reads or writes rows (its /metrics, scrapes' own taken "
          "off), idle, and in brackets before any agent connected (its reaper and its look for "
          "work every 5 s); whole fleet: the processes' idle queries added up; rows written: "
          "what PostgreSQL counted inserted, updated and deleted in the window (pg_stat_database): "
          "each process says it is alive every 10 s (one row), its machines are not written.")
    for r in rows:
        if r["codes"]:
            print(f"streams ended or refused ({r['agents']} agents over {r['processes']} "
                  f"processes, whole row), by why: {r['codes']}")
        over = [q - b for q, b in zip(r["queries"], r["baseline_queries"], strict=True)]
        checks = [("coordinator CPU <= 0.2 cores a process", max(r["cpu"]) <= 0.2,
                   f"{max(r['cpu']):.2f} at most"),
                  ("idle fleet's DB queries/s <= 1 a process", max(over) <= 1,
                   f"{max(over):.1f} at most over the baseline"),
                  ("dispatch p95 <= 50 ms", r["dispatch_p95_ms"] <= 50, f"{r['dispatch_p95_ms']:.1f}"),
                  ("memory < 50 KB/agent", max(r["kb_per_agent"]) < 50,
                   f"{max(r['kb_per_agent']):.1f} at most")]
        _goals(f"{r['agents']} agents over {r['processes']} processes", checks)

