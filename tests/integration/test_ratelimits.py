"""The database's rate-limit counters answer as the `limits` library's own memory storage
does (a contract test: the same hits, the same answers), on SQLite and PostgreSQL; and a
limit holds across two stores on one database, as two coordinator processes have."""

from __future__ import annotations

import threading
import time

import pytest
from limits import RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import MemoryStorage

from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.ratelimits import Limiter
from campugrid.coordinator.store import Store

pytestmark = pytest.mark.integration


def _hits(limiter: Limiter, item, who: str, n: int) -> list[bool]:
    return [limiter.hit(item, "kind", who) for _ in range(n)]


class Clock:
    """Time as both storages read it (time.time), moved by the test: the same windows for both."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "time", c)
    return c


@pytest.fixture
def memory() -> Limiter:
    storage = MemoryStorage()
    yield Limiter(storage)
    storage.timer.cancel()


def test_the_same_hits_get_the_same_answers_as_the_librarys_memory_storage(store: Store, memory: Limiter,
                                                                          clock: Clock):
    ours = store.limiter
    for item, who, n in ((RateLimitItemPerMinute(5), "a", 8), (RateLimitItemPerMinute(1), "b", 3),
                         (RateLimitItemPerSecond(50), "c", 60)):
        assert _hits(ours, item, who, n) == _hits(memory, item, who, n)
        # Refused hits leave no count behind in either: the next is refused too.
        assert ours.hit(item, "kind", who) is memory.hit(item, "kind", who) is False
        assert ours.retry_after(item, "kind", who) == memory.retry_after(item, "kind", who)
    # Other callers, other counts.
    assert ours.hit(RateLimitItemPerMinute(1), "kind", "d") is memory.hit(RateLimitItemPerMinute(1), "kind", "d")


@pytest.mark.parametrize("later", [10.0, 15.0, 25.0, 59.0, 61.0, 75.0, 119.0, 125.0])
def test_a_window_ends_and_weighs_on_the_next_as_the_library_says(store: Store, memory: Limiter,
                                                                  clock: Clock, later: float):
    item = RateLimitItemPerMinute(6)
    clock.now += 5
    assert _hits(store.limiter, item, "w", 7) == _hits(memory, item, "w", 7) == [True] * 6 + [False]
    clock.now += later  # the same window, the next (where this one still weighs in), or later
    assert _hits(store.limiter, item, "w", 7) == _hits(memory, item, "w", 7)
    assert store.limiter.retry_after(item, "w") == memory.retry_after(item, "w")


def test_an_exact_count_holds_across_the_turn_of_a_window_as_the_library_says(store: Store,
                                                                            memory: Limiter,
                                                                            clock: Clock):
    """Lockouts (console sign-ins for unknown names) count exactly: the fifth failure in 15
    minutes is refused even when the clock-aligned window turns just before it, where the
    sliding window's estimate (floor of 4 x 0.9998 + 0, plus this hit) lets it through."""
    item = RateLimitItemPerMinute(4, 15)
    clock.now = 1_800_000_000.0 - 0.1  # just before a 15-minute window turns (1.8e9 % 900 == 0)
    for limiter in (store.limiter, memory):
        assert [limiter.hit(item, "x", exact=True) for _ in range(4)] == [True] * 4
    clock.now += 0.2
    assert store.limiter.hit(item, "x", exact=True) is memory.hit(item, "x", exact=True) is False
    assert store.limiter.retry_after(item, "x", exact=True) \
        == memory.retry_after(item, "x", exact=True) == 900
    # What the sliding window answers at the same turn, for other callers.
    clock.now -= 0.2
    assert all(store.limiter.hit(item, "y") for _ in range(4))
    clock.now += 0.2
    assert store.limiter.hit(item, "y") is True
    clock.now += 900.0  # the exact window has ended: a new one starts with this hit
    assert store.limiter.hit(item, "x", exact=True) is memory.hit(item, "x", exact=True) is True


def test_a_limit_holds_across_two_processes_on_one_database(db_url: str):
    """Two stores on one database count together, also when they hit at the same time."""
    engines = [make_engine(db_url), make_engine(db_url)]
    migrate(engines[0])
    stores = [Store(e) for e in engines]
    try:
        item = RateLimitItemPerMinute(20)
        allowed: list[bool] = []
        lock = threading.Lock()

        def hammer(s: Store) -> None:
            for _ in range(15):
                ok = s.limiter.hit(item, "register", "198.51.100.7")
                with lock:
                    allowed.append(ok)

        threads = [threading.Thread(target=hammer, args=(s,)) for s in stores for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(allowed) == 60
        assert allowed.count(True) == 20
        assert stores[1].counters.prune() == 0  # nothing has expired yet
    finally:
        for s in stores:
            s.close()
