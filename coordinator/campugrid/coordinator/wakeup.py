"""Held Lease calls: an idle agent's ask for work waits here for work instead of coming back
every second.

An agent's Lease may ask to be held (`wait_ms`). When nothing is queued for its machine, the
call waits for one of:
- a change in this process that queues work (a submit, a hand-back, expired or revoked
  leases): `notify()` wakes every held call, which then tries to claim, as a fresh Lease
  would (one that found nothing it can take looks again no sooner than MIN_GAP_S later);
- on PostgreSQL, the same news from the other coordinator processes: `notify()` also sends
  a NOTIFY, and each process LISTENs on a connection of its own (`PostgresRelay`);
- every RECHECK_S, a look of its own: what no notification told of (a process's NOTIFY
  lost with its connection, or SQLite's processes, which have no such channel) is found
  that late at most, as an agent polling once a second would;
- the end of the hold, or the agent going away (a cancelled call claims nothing).

Each held call holds a gRPC worker thread, so at most `max_held` are held at once; beyond
that a Lease is answered at once, as before, and the agent waits its own poll interval.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Iterator

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from campugrid.coordinator.db import dialect_of

log = logging.getLogger("campugrid.coordinator.wakeup")
CHANNEL = "campugrid_work"

RECHECK_S = 1.0  # a held call looks for work queued by another process this often
# After finding nothing it can take, a held call looks again no sooner than this: a stream of
# submits for other machines costs each held call at most 1/MIN_GAP_S claims a second.
MIN_GAP_S = 0.2
MAX_HOLD_S = 20.0  # the longest a Lease is held, whatever it asks


class Wakeup:
    def __init__(self, max_held: int) -> None:
        """`max_held`: calls held at once (Settings.held_leases); each holds a worker
        thread, and server.py adds that many."""
        self.max_held = max_held
        self._changed = threading.Condition()
        self._generation = 0
        self._held = 0
        self.relay: Callable[[], None] | None = None  # tells the other processes (PostgreSQL)
        # Told of every wake too, after the held calls (fleet.py's dispatcher); quick, and
        # never blocking: a wake comes from any thread.
        self.listeners: list[Callable[[], None]] = []

    @property
    def held(self) -> int:
        """Calls held now."""
        return self._held

    @property
    def generation(self) -> int:
        """Counts notifications: read it before looking for work, wait from it after."""
        return self._generation

    def notify(self) -> None:
        """Work may have been queued: every held call looks again, here and, through the
        relay, in the other coordinator processes."""
        self.wake()
        if self.relay is not None:
            self.relay()

    def wake(self) -> None:
        """Every held call of this process looks again."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
        for listener in list(self.listeners):
            listener()

    @contextlib.contextmanager
    def hold(self) -> Iterator[bool]:
        """A place among the held calls: False when all `max_held` are taken (answer the
        call at once)."""
        with self._changed:
            placed = self._held < self.max_held
            self._held += placed
        try:
            yield placed
        finally:
            if placed:
                with self._changed:
                    self._held -= 1

    def wait(self, seen: int, timeout_s: float) -> int:
        """Wait until notified after generation `seen`, or `timeout_s`; the generation now."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen, timeout=max(0.0, timeout_s))
            return self._generation


class PostgresRelay:
    """Wakeups across the coordinator processes of one PostgreSQL database: `send` NOTIFYs
    (from Wakeup.notify), and a thread LISTENs on a connection of its own and wakes this
    process's held calls. A process's own notifications carry its token and are not news
    to it. While the listening connection is down, it is opened again every second; held
    calls meanwhile still look every RECHECK_S."""

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
