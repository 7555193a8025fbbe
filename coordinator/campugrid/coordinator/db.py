"""The database: engines, transactions, and the schema brought to the Alembic head.

`Database` is the one transaction object the stores share (jobs, shards, machines, claims):
a writing transaction, a reading one, and the writer's raw connection for the claim path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from campugrid.coordinator.models import Job
from campugrid.protocol.errors import NotFound

MIGRATIONS = Path(__file__).with_name("migrations")
READ_ONLY = "campugrid_read_only"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_setup(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")  # acknowledged means on disk
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front: no deadlocked lock upgrades. Reads
            # (marked read-only) take none, so they never queue behind writers in WAL mode.
            if conn.get_execution_options().get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


class Database:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._session = sessionmaker(engine, expire_on_commit=False)
        self._reader = sessionmaker(engine.execution_options(**{READ_ONLY: True}),
                                    expire_on_commit=False)
        # SQLite has one writer at a time; waiting for it inside SQLite means its busy
        # handler's sleeps (up to 100 ms each). Waiting on a lock here hands over at once.
        # (Other processes on the same file still work, through the busy timeout.)
        self._writer: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if engine.dialect.name == "sqlite" else contextlib.nullcontext())

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """A writing transaction (an ORM session), committed when the block ends."""
        with self._writer, self._session.begin() as s:
            yield s

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads (no write lock on SQLite)."""
        with self._reader.begin() as s:
            yield s

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        """A writing transaction on a Core connection: the claim path's, without the ORM."""
        with self._writer, self.engine.begin() as conn:
            yield conn


def job_row(s: Session, job_id: str) -> Job:
    """The job's row as the database has it now, or NotFound."""
    row = s.get(Job, job_id, populate_existing=True)
    if row is None:
        raise NotFound(f"no job {job_id}")
    return row


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def migrate(engine: Engine) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
