"""Held Lease calls: an idle agent's ask for work waits here for work instead of coming back
every second.

An agent's Lease may ask to be held (`wait_ms`). When nothing is queued for its machine, the
call waits for one of:
- a change in this process that queues work (a submit, a hand-back, expired leases, the end
  of an attempt or a shard session): `notify()` wakes every held call, which then tries to
  claim, as a fresh Lease would (one that found nothing it can take looks again no sooner
  than MIN_GAP_S later);
- every RECHECK_S, a look of its own: work another coordinator process queued (they share
  only the database) is found that late at most, as an agent polling once a second would;
- the end of the hold, or the agent going away (a cancelled call claims nothing).

Each held call holds a gRPC worker thread, so at most `max_held` are held at once; beyond
that a Lease is answered at once, as before, and the agent waits its own poll interval.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

RECHECK_S = 1.0  # a held call looks for work queued by another process this often
# After finding nothing it can take, a held call looks again no sooner than this: a stream of
# submits for other machines costs each held call at most 1/MIN_GAP_S claims a second.
MIN_GAP_S = 0.2
MAX_HOLD_S = 20.0  # the longest a Lease is held, whatever it asks
MAX_HELD = 16  # held calls at once; each holds a worker thread (server.py adds that many)


class Wakeup:
    def __init__(self, max_held: int = MAX_HELD) -> None:
        self.max_held = max_held
        self._changed = threading.Condition()
        self._generation = 0
        self._held = 0

    @property
    def held(self) -> int:
        """Calls held now."""
        return self._held

    @property
    def generation(self) -> int:
        """Counts notifications: read it before looking for work, wait from it after."""
        return self._generation

    def notify(self) -> None:
        """Work may have been queued: every held call looks again."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

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
