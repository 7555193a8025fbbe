"""News of work: whatever may have queued work (a submit, a hand-back, expired or revoked
leases) calls `notify()`, and the dispatcher (fleet.py) runs a round for the idle machines
connected to this process.

On PostgreSQL the news also goes to the other coordinator processes of the database:
`notify()` sends a NOTIFY, and each process LISTENs on a connection of its own
(`PostgresRelay`) and wakes its own dispatcher. What no notification told of (a NOTIFY lost
with its connection, or SQLite's processes, which have no such channel) the dispatcher finds
at its own look, every fleet.RECHECK_S.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from campugrid.coordinator.db import dialect_of

log = logging.getLogger("campugrid.coordinator.wakeup")
CHANNEL = "campugrid_work"


class Wakeup:
    def __init__(self) -> None:
        self.relay: Callable[[], None] | None = None  # tells the other processes (PostgreSQL)
        # Told of every wake (fleet.py's dispatcher); quick, and never blocking: a wake comes
        # from any thread.
        self.listeners: list[Callable[[], None]] = []

    def notify(self) -> None:
        """Work may have been queued: the dispatchers look again, here and, through the
        relay, in the other coordinator processes."""
        self.wake()
        if self.relay is not None:
            self.relay()

    def wake(self) -> None:
        """This process's dispatcher looks again."""
        for listener in list(self.listeners):
            listener()


class PostgresRelay:
    """Wakeups across the coordinator processes of one PostgreSQL database: `send` NOTIFYs
    (from Wakeup.notify), and a thread LISTENs on a connection of its own and wakes this
    process's dispatcher. A process's own notifications carry its token and are not news
    to it. While the listening connection is down, it is opened again every second; the
    dispatcher meanwhile still looks every fleet.RECHECK_S."""

    def __init__(self, engine: Engine, wakeup: Wakeup) -> None:
        self.engine, self.wakeup = engine, wakeup
        self.token = secrets.token_hex(8)
        self.conninfo = engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True, name="work-relay")

    def start(self) -> PostgresRelay:
        self._thread.start()
        self.wakeup.relay = self.send
        return self

    def stop(self) -> None:
        self.wakeup.relay = None
        self._stop.set()
        self._thread.join(5)

    def send(self) -> None:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_notify(:channel, :token)"),
                             {"channel": CHANNEL, "token": self.token})
                conn.commit()
        except SQLAlchemyError as e:  # the others find the work on their own look instead
            log.warning("could not tell the other coordinator processes of new work: %s", e)

    def _listen(self) -> None:
        import psycopg  # only with PostgreSQL (the `postgres` extra), as SQLAlchemy's driver

        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    while not self._stop.is_set():  # each as it comes; a second at most
                        for note in conn.notifies(timeout=1.0):
                            if note.payload != self.token:
                                self.wakeup.wake()
            except psycopg.Error as e:
                self.listening.clear()
                log.warning("not listening for other coordinator processes' work (%s); "
                            "trying again in 1 s", e)
                self._stop.wait(1.0)


def relay(engine: Engine, wakeup: Wakeup) -> PostgresRelay | None:
    """The relay between this process and the others on the same database, started; None
    where there is nothing to relay through (SQLite)."""
    return PostgresRelay(engine, wakeup).start() if dialect_of(engine).notifications else None
