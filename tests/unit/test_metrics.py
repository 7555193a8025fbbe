"""Metrics without a network: bearer tokens (only digests kept, compared in constant time),
and what the registries expose, read back with prometheus_client's own text parser."""

from __future__ import annotations

import hashlib

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from campugrid.agent import metrics as agent_metrics
from campugrid.agent.gpus import GpuPolicy
from campugrid.coordinator.db import STATEMENTS, Database, make_engine
from campugrid.coordinator.metrics import CoordinatorMetrics, bearer, token_digest
from tests.unit.test_gpus import FakeNvml

MB = 1024 * 1024


def samples(text: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_only_a_bearer_header_carries_a_token():
    assert bearer("Bearer cgm_abc") == "cgm_abc"
    assert bearer("  bearer   cgm_abc  ") == "cgm_abc"
    assert bearer("Basic dXNlcjpwdw==") == ""
    assert bearer("Bearer") == "" and bearer("") == ""
    assert token_digest("cgm_abc") == hashlib.sha256(b"cgm_abc").hexdigest()


def test_the_agent_keeps_only_the_digest_and_a_new_token_replaces_the_old(tmp_path):
    file = tmp_path / agent_metrics.TOKEN_FILE
    assert not agent_metrics.allowed("Bearer anything", file)  # none minted: nobody scrapes
    first = agent_metrics.mint_token(tmp_path)
    assert file.read_text().strip() == hashlib.sha256(first.encode()).hexdigest()
    assert first not in file.read_text() and file.stat().st_mode & 0o777 == 0o600
    assert agent_metrics.allowed(f"Bearer {first}", file)
    assert not agent_metrics.allowed(f"Bearer {first}x", file)
    assert not agent_metrics.allowed(f"Basic {first}", file)
    assert not agent_metrics.allowed("Bearer ", file)
    second = agent_metrics.mint_token(tmp_path)
    assert second != first
    assert agent_metrics.allowed(f"Bearer {second}", file)
    assert not agent_metrics.allowed(f"Bearer {first}", file)


def test_agent_metrics_name_each_gpu_with_its_free_and_reserved_memory_and_the_process():
    m = agent_metrics.AgentMetrics()
    assert not any(name.startswith("campugrid_agent_gpu") for name, _ in samples(generate_latest(m.registry)))
    m.gpus.policy, m.gpus.nvml = GpuPolicy(reserve_mb=1000), FakeNvml()
    m.gpus.hold(["GPU-bbb"], 4000)
    m.build_seconds.labels("ok").observe(12.0)
    m.checkpoint_bytes.inc(5000)
    m.sandbox_start_seconds.labels("run").observe(0.4)
    m.build_cache_hits.labels("registry").inc()
    got = samples(generate_latest(m.registry))
    aaa = (("gpu", "GPU-aaa"), ("name", "NVIDIA GeForce RTX 4090"))
    bbb = (("gpu", "GPU-bbb"), ("name", "NVIDIA A100-SXM4-80GB"))
    assert got["campugrid_agent_gpu_free_bytes", aaa] == (23000 - 1000) * MB
    assert got["campugrid_agent_gpu_total_bytes", bbb] == 81920 * MB
    assert got["campugrid_agent_gpu_reserved_bytes", bbb] == 4000 * MB
    assert got["campugrid_agent_gpu_reserved_bytes", aaa] == 0
    assert got["campugrid_agent_build_seconds_count", (("outcome", "ok"),)] == 1
    assert got["campugrid_agent_build_cache_hits_total", (("source", "registry"),)] == 1
    assert got["campugrid_agent_checkpoint_bytes_total", ()] == 5000
    assert got["campugrid_agent_sandbox_start_seconds_sum", (("kind", "run"),)] == 0.4
    assert got["process_resident_memory_bytes", ()] > 0
    assert ("process_cpu_seconds_total", ()) in got
    m.gpus.hold((), 0)  # the task ended
    assert samples(generate_latest(m.registry))["campugrid_agent_gpu_reserved_bytes", bbb] == 0


def test_coordinator_counters_move_and_a_scrape_survives_an_unreadable_database():
    # An empty in-memory database: no tables, so the jobs cannot be read.
    m = CoordinatorMetrics(Database(create_engine("sqlite://")))
    m.leased(0.002, None, handed_out=True)
    m.leased(0.001, None, handed_out=False)
    m.refused("grpc", "stale")
    m.refused("rest", "unsigned")
    m.checkpoint_recorded(1234)
    got = samples(generate_latest(m.registry))
    assert got["campugrid_database_up", ()] == 0
    assert not any(name == "campugrid_jobs" for name, _ in got)
    assert got["campugrid_leases_total", (("outcome", "task"),)] == 1
    assert got["campugrid_leases_total", (("outcome", "empty"),)] == 1
    assert got["campugrid_lease_seconds_count", ()] == 2
    assert got["campugrid_lease_seconds_sum", ()] == 0.003
    assert got["campugrid_queue_wait_seconds_count", ()] == 0
    assert got["campugrid_refused_calls_total", (("reason", "stale"), ("transport", "grpc"))] == 1
    assert got["campugrid_refused_calls_total", (("reason", "unsigned"), ("transport", "rest"))] == 1
    assert got["campugrid_checkpoint_bytes_total", ()] == 1234
    assert got["campugrid_checkpoints_total", ()] == 1
    # Its garbage collections, by generation: a full one walks every stream's objects.
    assert {labels for name, labels in got if name == "python_gc_collections_total"} == {
        (("generation", str(g)),) for g in range(3)}


def test_every_statement_an_engine_sends_is_counted(tmp_path):
    """What an idle fleet costs the database is read from this count (bench/fleet.py)."""
    lone = make_engine(f"sqlite:///{tmp_path / 'a.db'}", single_statements=True)
    before = STATEMENTS.count
    with lone.connect() as conn:
        for _ in range(3):
            conn.execute(text("SELECT 1"))
    assert STATEMENTS.count - before == 3
    engine = make_engine(f"sqlite:///{tmp_path / 'b.db'}")  # our own BEGIN, and its PRAGMA
    before, queries = STATEMENTS.count, STATEMENTS.queries
    with engine.begin() as conn:
        conn.execute(text("SELECT 1"))
    assert STATEMENTS.count - before == 3
    assert STATEMENTS.queries - queries == 1  # the SELECT; not BEGIN IMMEDIATE nor the PRAGMA
    m = CoordinatorMetrics(Database(create_engine("sqlite://")))
    shown = samples(generate_latest(m.registry))
    assert shown["campugrid_db_statements_total", ()] == STATEMENTS.count  # an engine not
    assert shown["campugrid_db_queries_total", ()] == STATEMENTS.queries  # ours is not counted
