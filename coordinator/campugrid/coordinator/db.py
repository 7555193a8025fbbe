"""The database: engines, transactions, and the schema brought to the Alembic head.

`Database` is the one transaction object the stores share (jobs, shards, machines, claims):
a writing transaction, a reading one, and the writer's raw connection for the claim path.
`Dialect` says where SQLite and PostgreSQL differ; every other module asks it (`dialect_of`)
rather than compare the dialect's name itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from campugrid.coordinator.models import Job
from campugrid.protocol.errors import NotFound

MIGRATIONS = Path(__file__).with_name("migrations")
MIGRATION_LOCK = 0x6367_6D696772  # the advisory lock migrations take on PostgreSQL ('cgmigr')
READ_ONLY = "campugrid_read_only"
# A transaction whose loss in a crash harms nothing (the rate counters): committed without
# waiting for the disk (SQLite: synchronous=NORMAL for it; PostgreSQL: synchronous_commit off).
# The nonce store goes further: single statements on an engine of their own (make_engine).
LAZY = "campugrid_lazy_commit"


@dataclasses.dataclass(frozen=True)
class Dialect:
    """Where the two databases differ, as the modules that care need to know it."""

    name: str
    one_writer: bool  # SQLite: one writer per file (side files, a process lock, a file lock)
    row_locks: bool  # PostgreSQL: SELECT ... FOR UPDATE SKIP LOCKED, and advisory locks
    notifications: bool  # PostgreSQL: LISTEN/NOTIFY between coordinator processes
    lazy_commit: str | None  # the statement that makes this transaction's commit not wait
    insert: Any  # INSERT with ON CONFLICT (sqlalchemy.dialects.*.insert)


SQLITE = Dialect("sqlite", one_writer=True, row_locks=False, notifications=False,
                 lazy_commit=None, insert=sqlite.insert)
POSTGRESQL = Dialect("postgresql", one_writer=False, row_locks=True, notifications=True,
                     lazy_commit="SET LOCAL synchronous_commit = off", insert=postgresql.insert)


def dialect_of(bind: Engine | Connection) -> Dialect:
    """The dialect of an engine or a connection (SQLite, else PostgreSQL)."""
    return SQLITE if bind.dialect.name == "sqlite" else POSTGRESQL


_CONTROL = ("BEGIN", "PRAGMA", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")


class _Statements:
    """Statements this process sent to its databases, through every engine make_engine made
    (BEGIN and PRAGMA included; a COMMIT is not a statement here), and of them the queries
    (what reads or writes rows, not a transaction's control): /metrics shows both
    (campugrid_db_statements_total, campugrid_db_queries_total), and bench/fleet.py reads
    what an idle fleet costs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.queries = 0

    def sent(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        query = not statement.lstrip()[:9].upper().startswith(_CONTROL)
        with self._lock:
            self.count += 1
            self.queries += query


STATEMENTS = _Statements()


def make_engine(url: str, *, single_statements: bool = False) -> Engine:
    """An engine on `url`; with `single_statements`, one whose statements each commit on
    their own without waiting for the disk (for what a crash may lose: the nonce store), so
    that a write is two round trips on PostgreSQL instead of five (the pool's ping and the
    statement, without BEGIN, SET LOCAL and COMMIT) and one statement on SQLite instead of
    four. Every statement it sends is counted (STATEMENTS)."""
    engine = _engine(url, single_statements)
    event.listen(engine, "before_cursor_execute", STATEMENTS.sent)
    return engine


def _engine(url: str, single_statements: bool) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                               **({"isolation_level": "AUTOCOMMIT"} if single_statements else {}))

        @event.listens_for(engine, "connect")
        def _sqlite_setup(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below (or none)
            cur = dbapi_conn.cursor()
            _wal(cur)
            # acknowledged means on disk (but for single statements: see above)
            cur.execute("PRAGMA synchronous=NORMAL" if single_statements else "PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        if single_statements:
            return engine

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front: no deadlocked lock upgrades. Reads
            # (marked read-only) take none, so they never queue behind writers in WAL mode.
            options = conn.get_execution_options()
            if options.get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
                return
            # Per transaction: the connection goes back to the pool with whatever was set.
            conn.exec_driver_sql("PRAGMA synchronous=NORMAL" if options.get(LAZY)
                                 else "PRAGMA synchronous=FULL")
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if single_statements:  # a small pool: each statement holds a connection for one round trip
        return create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True, pool_size=4,
                             max_overflow=8, connect_args={"options": "-c synchronous_commit=off"})
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _wal(cur: Any) -> None:
    """Put the file in WAL mode. The switch needs the file to itself, and SQLite refuses it
    with "database is locked" at once, past its busy timeout, while another process opening
    the same new file holds it: so try again here, for up to 30 s (the busy timeout)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def side_database(engine: Engine, name: str, *tables: Any, single_statements: bool = False) -> Engine:
    """On SQLite, a file of its own beside the main one for `tables` (created there), so that
    their writes do not wait for the one writer of the main file; elsewhere the same database
    (PostgreSQL locks rows, not the database), through the same engine or, for
    `single_statements` (make_engine), one of its own. Every process on the main file uses
    the same side file."""
    if not dialect_of(engine).one_writer:
        return (make_engine(engine.url.render_as_string(hide_password=False), single_statements=True)
                if single_statements else engine)
    if not engine.url.database or engine.url.database == ":memory:":
        return engine
    path = Path(engine.url.database)
    side = make_engine(f"sqlite:///{path.with_name(f'{path.stem}-{name}{path.suffix}')}",
                       single_statements=single_statements)
    from campugrid.coordinator.models import Base

    Base.metadata.create_all(side, tables=list(tables))
    return side


class Database:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._session = sessionmaker(engine, expire_on_commit=False)
        self._reader = sessionmaker(engine.execution_options(**{READ_ONLY: True}),
                                    expire_on_commit=False)
        self._lazy_engine = engine.execution_options(**{LAZY: True})
        self._lazy = sessionmaker(self._lazy_engine, expire_on_commit=False)
        # SQLite has one writer at a time; waiting for it inside SQLite means its busy
        # handler's sleeps (up to 100 ms each). Waiting on a lock here hands over at once.
        # (Other processes on the same file still work, through the busy timeout.)
        self._writer: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if dialect_of(engine).one_writer else contextlib.nullcontext())
        self.dialect = dialect_of(engine)

    @contextlib.contextmanager
    def tx(self, *, durable: bool = True) -> Iterator[Session]:
        """A writing transaction (an ORM session), committed when the block ends; on disk
        before it returns unless `durable` is False (for what a crash may lose)."""
        with self._writer, (self._session if durable else self._lazy).begin() as s:
            if not durable and self.dialect.lazy_commit:
                s.execute(text(self.dialect.lazy_commit))
            yield s

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads (no write lock on SQLite)."""
        with self._reader.begin() as s:
            yield s

    @contextlib.contextmanager
    def statements(self) -> Iterator[Connection]:
        """A connection whose statements commit alone on an engine made with
        `single_statements` (make_engine), and as one transaction on any other (an in-memory
        SQLite database has no side file); one writer at a time on SQLite, as for tx."""
        with self._writer, self.engine.connect() as conn:
            yield conn
            conn.commit()

    @contextlib.contextmanager
    def connect(self, *, durable: bool = True) -> Iterator[Connection]:
        """A writing transaction on a Core connection: the claim path's, without the ORM
        (`durable` as for tx)."""
        engine = self.engine if durable else self._lazy_engine
        with self._writer, engine.begin() as conn:
            if not durable and self.dialect.lazy_commit:
                conn.execute(text(self.dialect.lazy_commit))
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
    """Bring the schema to the head. Coordinator processes starting together on one database
    take turns: on PostgreSQL under an advisory lock held to the end of the transaction (the
    next finds the head already there); on SQLite, BEGIN IMMEDIATE serializes them."""
    cfg = alembic_config()
    with engine.begin() as conn:
        if dialect_of(engine).row_locks:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
