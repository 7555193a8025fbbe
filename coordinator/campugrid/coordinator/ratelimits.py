"""Rate limits that hold across every coordinator process: the `limits` library's sliding
window counter, on a storage of ours that keeps its counters in the database.

The strategy (weights, windows, Retry-After) stays the library's; only where the counts live
is ours. tests/integration/test_ratelimits.py runs the same hits against the library's own
MemoryStorage and this storage, on SQLite and PostgreSQL, and expects the same answers.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

from limits import RateLimitItem, strategies
from limits.storage import Storage
from limits.storage.base import SlidingWindowCounterSupport, TimestampedSlidingWindow
from sqlalchemy import Connection, Table, case, delete, select
from sqlalchemy.exc import SQLAlchemyError

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import RateCounter

_TABLE = cast(Table, RateCounter.__table__)


class DatabaseCounters(Storage, SlidingWindowCounterSupport, TimestampedSlidingWindow):
    """Counters by key with an expiry, one row each. A hit is one short transaction that
    counts and checks together, so a refused hit leaves no count behind (the library's
    memory storage takes it back afterwards instead)."""

    STORAGE_SCHEME = ["campugrid+database"]

    def __init__(self, db: Database) -> None:
        super().__init__()
        self.db = db
        self._insert: Any = db.dialect.insert

    @property
    def base_exceptions(self) -> type[Exception] | tuple[type[Exception], ...]:
        return SQLAlchemyError

    # --- the storage operations the library's strategies call -----------------------------

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        with self.db.connect(durable=False) as conn:
            return self._add(conn, key, expiry, amount, time.time())

    def decr(self, key: str, amount: int = 1) -> int:
        with self.db.connect(durable=False) as conn:
            return self._add(conn, key, 0, -amount, time.time())

    def get(self, key: str) -> int:
        with self.db.connect(durable=False) as conn:
            return self._get(conn, key, time.time())[0]

    def get_expiry(self, key: str) -> float:
        with self.db.connect(durable=False) as conn:
            count, expires = self._get(conn, key, time.time())
        return expires if count else time.time()

    def check(self) -> bool:
        try:
            with self.db.read() as s:
                s.execute(select(1))
            return True
        except SQLAlchemyError:
            return False

    def reset(self) -> int | None:
        with self.db.connect(durable=False) as conn:
            return int(conn.execute(delete(_TABLE)).rowcount)

    def clear(self, key: str) -> None:
        with self.db.connect(durable=False) as conn:
            conn.execute(delete(_TABLE).where(_TABLE.c.key == key))

    def acquire_sliding_window_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        if amount > limit:
            return False
        now = time.time()
        previous_key, current_key = self.sliding_window_keys(key, expiry, now)
        try:
            with self.db.connect(durable=False) as conn:
                previous, _ = self._get(conn, previous_key, now)
                current = self._add(conn, current_key, 2 * expiry, amount, now)
                if math.floor(previous * _previous_ttl(previous, expiry, now) / expiry + current) > limit:
                    raise _Refused  # rolls the count back
        except _Refused:
            return False
        return True

    def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        now = time.time()
        previous_key, current_key = self.sliding_window_keys(key, expiry, now)
        with self.db.connect(durable=False) as conn:
            previous, _ = self._get(conn, previous_key, now)
            current, _ = self._get(conn, current_key, now)
        current_ttl = (1 - ((now / expiry) % 1)) * expiry + expiry
        return previous, _previous_ttl(previous, expiry, now), current, current_ttl

    def clear_sliding_window(self, key: str, expiry: int) -> None:
        previous_key, current_key = self.sliding_window_keys(key, expiry, time.time())
        with self.db.connect(durable=False) as conn:
            conn.execute(delete(_TABLE).where(_TABLE.c.key.in_([previous_key, current_key])))

    def prune(self) -> int:
        """Forget windows that have ended (the reaper calls this now and then)."""
        with self.db.connect(durable=False) as conn:
            return int(conn.execute(delete(_TABLE).where(_TABLE.c.expires_at < time.time())).rowcount)

    # --- rows ---------------------------------------------------------------------------------

    def _get(self, conn: Connection, key: str, now: float) -> tuple[int, float]:
        row = conn.execute(select(_TABLE.c.count, _TABLE.c.expires_at)
                           .where(_TABLE.c.key == key[:300])).one_or_none()
        if row is None or row[1] <= now:
            return 0, now
        return int(row[0]), float(row[1])  # (by position: a Row's .count is tuple.count)

    def _add(self, conn: Connection, key: str, expiry: int, amount: int, now: float) -> int:
        """Add `amount` to the key's count (a new window if it has expired), in one statement
        so that concurrent hits from several processes all count."""
        stmt = self._insert(_TABLE).values(key=key[:300], count=amount, expires_at=now + expiry)
        expired = _TABLE.c.expires_at <= now
        stmt = stmt.on_conflict_do_update(index_elements=[_TABLE.c.key], set_={
            # A new window starts with this hit; a running one keeps its expiry.
            "count": _case(expired, stmt.excluded.count, _TABLE.c.count + stmt.excluded.count),
            "expires_at": _case(expired, stmt.excluded.expires_at, _TABLE.c.expires_at),
        }).returning(_TABLE.c.count)
        return int(conn.execute(stmt).scalar_one())


class _Refused(Exception):
    pass


def _case(when: Any, then: Any, otherwise: Any) -> Any:
    return case((when, then), else_=otherwise)


def _previous_ttl(previous: int, expiry: int, now: float) -> float:
    """How much of the previous window still weighs, as the library computes it."""
    return 0.0 if previous == 0 else (1 - (((now - expiry) / expiry) % 1)) * expiry


class Limiter:
    """The one limiter every boundary uses (REST, registrations, console sign-ins)."""

    def __init__(self, counters: Storage) -> None:
        self.counters = counters
        self._strategy = strategies.SlidingWindowCounterRateLimiter(counters)
        self._exact = strategies.FixedWindowRateLimiter(counters)

    def hit(self, item: RateLimitItem, *who: str, exact: bool = False) -> bool:
        """Counted in the library's sliding window; `exact`: in a window that starts with the
        caller's first hit, for lockouts. (The sliding window's estimate lets one more hit
        through at the turn of its clock-aligned windows: a lockout would then differ by one,
        at a time anyone can know.)"""
        return (self._exact if exact else self._strategy).hit(item, *who)

    def retry_after(self, item: RateLimitItem, *who: str, exact: bool = False) -> int:
        """Whole seconds until a refused caller may try again (at least 1)."""
        reset = (self._exact if exact else self._strategy).get_window_stats(item, *who).reset_time
        return max(1, int(reset - time.time() + 0.999))
