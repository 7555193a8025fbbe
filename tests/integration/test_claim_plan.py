"""The CPU claim's plan on PostgreSQL right after a burst of submissions, before any
statistics exist: an index scan in the claim's own order that stops at the first row, never
a sort of the whole queue (which made every lease cost 135 ms at 100k queued until
autovacuum analysed the table)."""

from __future__ import annotations

import datetime as dt
import secrets
import uuid

import pytest
from sqlalchemy import create_engine, insert, text
from sqlalchemy.dialects import postgresql

from campugrid.coordinator.claims import _NEXT_CPU_JOB_PG, _room
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.models import Job
from campugrid.coordinator.scheduler import MachineView
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState

pytestmark = pytest.mark.integration
# The claim path's own statement (claims.py), for a 16-CPU machine that lacks no limit.
CLAIM = str(_NEXT_CPU_JOB_PG.params(_room("m-1", MachineView(
    "m-1", "box", cpus=16, memory_mb=64 * 1024, disk_mb=500 * 1024))).compile(
    dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))


def test_a_fresh_queue_is_claimed_without_sorting_it(postgres):
    name = f"t_{secrets.token_hex(6)}"
    admin = create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine = make_engine(postgres.url.rsplit("/", 1)[0] + f"/{name}")
    try:
        migrate(engine)
        spec, now = JobSpec().to_json(), dt.datetime.now(dt.UTC)
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
            conn.execute(insert(Job), [
                {"id": str(uuid.uuid4()), "state": JobState.QUEUED.value, "spec_json": spec,
                 "context_key": "contexts/x.tar", "context_sha256": "0" * 64, "attempt": 0,
                 "max_attempts": 3, "drained": 0, "gpus_needed": 0,
                 "created_at": now + dt.timedelta(microseconds=i), "updated_at": now}
                for i in range(20_000)])
        with engine.begin() as conn:
            plan = "\n".join(r[0] for r in conn.execute(text("EXPLAIN " + CLAIM)))
        assert "Index Scan using ix_jobs_state_gpus_created" in plan, plan
        assert "Sort" not in plan, plan
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()
