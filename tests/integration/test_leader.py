"""Several coordinator processes on one database: they migrate it together without tripping
over each other, and exactly one of them leads the reaper, handed over when it dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from campugrid.coordinator.db import alembic_config, make_engine
from campugrid.coordinator.leader import leadership

pytestmark = pytest.mark.integration

TAKE_AND_HOLD = textwrap.dedent("""
    import sys, time
    from campugrid.coordinator.db import alembic_config, make_engine
    from campugrid.coordinator.leader import leadership
    lead = leadership(make_engine(sys.argv[1]))
    print("leads" if lead.holds() else "follows", flush=True)
    time.sleep(600)
""")


def test_coordinators_starting_together_migrate_one_database_once(db_url: str):
    code = textwrap.dedent("""
        import sys, time
        from campugrid.coordinator.db import make_engine, migrate
        engine = make_engine(sys.argv[1])
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all at once
        migrate(engine)
    """)
    at = str(time.time() + 4)
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url, at], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errors)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        assert versions == [ScriptDirectory.from_config(alembic_config()).get_current_head()]
        assert "jobs" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_connections_opening_a_new_sqlite_file_at_once_all_get_wal(tmp_path):
    """Switching a file to WAL needs it to itself, and SQLite refuses the loser of a race at
    once, past its busy timeout (CI once saw a coordinator die of it at start). Six at a time,
    sixty files: without the retry about one file in forty lost a connection."""
    for i in range(60):
        url = f"sqlite:///{tmp_path}/race-{i}.db"
        engines = [make_engine(url) for _ in range(6)]
        start = threading.Barrier(len(engines))
        failures: list[BaseException] = []

        def open_one(engine):
            start.wait()
            try:
                with engine.connect() as conn:
                    assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            except BaseException as e:  # collected, and reported below
                failures.append(e)

        threads = [threading.Thread(target=open_one, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in engines:
            e.dispose()
        assert failures == []


def test_one_process_leads_and_another_takes_over_when_it_is_killed(db_url: str):
    engine = make_engine(db_url)
    holder = subprocess.Popen([sys.executable, "-c", TAKE_AND_HOLD, db_url], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "leads"
        ours = leadership(engine)
        assert not ours.holds()
        assert not ours.holds()  # asking again does not take it either
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not ours.holds():
            assert time.monotonic() < deadline, "nobody took the lead after the leader died"
            time.sleep(0.1)
        assert ours.holds()
        ours.resign()
        other = leadership(engine)
        assert other.holds()  # a resigned lead is free at once
        other.resign()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite's lock is a file
def test_a_leader_whose_database_connection_breaks_stops_leading(db_url: str):
    engine = make_engine(db_url)
    first, second = leadership(engine), leadership(engine)
    try:
        assert first.holds() and not second.holds()
        with engine.connect() as conn:  # the server ends the leader's session
            conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_locks "
                              "WHERE locktype = 'advisory' AND granted"))
        assert not first.holds()
        assert second.holds()
        assert not first.holds()
    finally:
        first.resign()
        second.resign()
        engine.dispose()
