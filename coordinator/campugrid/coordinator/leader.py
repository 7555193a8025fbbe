"""Which coordinator process runs the lease reaper: one at a time, taken over by another
as soon as the holder dies.

On PostgreSQL the leader holds a session-level advisory lock on a connection of its own: the
server drops it when that process dies or its connection breaks, and the next process to ask
takes it. On SQLite (one host) a file lock beside the database file does the same through
the kernel.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from campugrid.coordinator.db import dialect_of

log = logging.getLogger("campugrid.coordinator.leader")
# The advisory lock's key (any bigint, the same in every process): 'cgreap'.
REAPER_LOCK = 0x636772656170


class Leadership(Protocol):
    def holds(self) -> bool:
        """Take the lead if nobody holds it; True while this process holds it."""
        ...

    def resign(self) -> None: ...


def leadership(engine: Engine) -> Leadership:
    if dialect_of(engine).row_locks:
        return AdvisoryLock(engine, REAPER_LOCK)
    database = engine.url.database
    if not database or database == ":memory:":
        return Alone()
    return FileLock(Path(database).with_name(Path(database).name + ".leader"))


class AdvisoryLock:
    def __init__(self, engine: Engine, key: int) -> None:
        self.engine = engine
        self.key = key
        self._conn: Connection | None = None

    def holds(self) -> bool:
        try:
            if self._conn is not None:  # still ours while the connection lives
                self._conn.execute(text("SELECT 1"))
                return True
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            got = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key}).scalar()
            if got:
                self._conn = conn
                return True
            conn.close()
            return False
        except SQLAlchemyError as e:
            log.warning("the reaper's lock connection failed (%s): another process may lead now", e)
            self._drop()
            return False

    def resign(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            # Closing the connection itself (not returning it to the pool) ends the lock.
            try:
                self._conn.invalidate()
                self._conn.close()
            except SQLAlchemyError:
                pass
            self._conn = None


class FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def holds(self) -> bool:
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def resign(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


class Alone:
    """An in-memory database has one process."""

    def holds(self) -> bool:
        return True

    def resign(self) -> None:
        pass
