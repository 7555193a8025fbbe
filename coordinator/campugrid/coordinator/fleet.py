"""The machines connected to this coordinator process on a stream (AgentService.Connect), and
the dispatcher that hands them work: an idle machine costs nothing while nothing changes.

A connected machine says when it is ready for work and what a task can be given there (its
offer); the fleet keeps that in memory. When work may have come (Wakeup: a submit, a
hand-back, an expiry; on PostgreSQL also another process's), and every RECHECK_S in case a
notification was lost, a dispatch round runs on a thread. It reads first what the oldest
queued jobs need of a machine (claims.queued_demand, one statement; nothing queued, nothing
more). The idle machines are grouped by what they offer (machines that offer the same are
offered the same jobs); a group none of those needs fits (scheduler.may_hold) is passed
over, and for the others the claim (claims.py, the one guarded place) is tried for its
machines in turn while it finds work; claims that find nothing end that group's turn, and a
round claims no more than the work it read queued can take (a job, or a sharded job's
shards). The leases go down their machines' streams when the round ends, and a machine is
busy until it says it is ready again. A fleet of machines that all differ (each says its
own free memory) thus costs a round one statement and an in-memory pass, not a claim per
machine.

Idle, the fleet sends the database: the queue's demand every RECHECK_S and when woken, a
status read when a machine's status may have changed (the status epoch, read every
RECHECK_S), and every SEEN_S that this process is alive (one row: its connected machines
are seen as long as it is, models.Machine.seen_at), with the machines that connected or
left since.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from campugrid.coordinator.machines import Status
from campugrid.coordinator.scheduler import MachineView, may_hold
from campugrid.coordinator.services.leasing import LeaseService
from campugrid.coordinator.services.machines import MachineService
from campugrid.coordinator.views import Lease
from campugrid.coordinator.wakeup import Wakeup
from campugrid.protocol import agent_pb2 as pb

log = logging.getLogger("campugrid.coordinator.fleet")
RECHECK_S = 5.0  # a round even without news (a lost notification, SQLite's other processes)
SEEN_S = 10.0  # how often this process says it is alive (and which machines came and went)
TRIES_PER_GROUP = 2  # machines of one group tried before its turn ends on a claim finding none
DEMAND_ROWS = 500  # the queued jobs whose needs a round reads (the oldest, as claims take them)
# A machine taken that has not said it is ready within this no longer counts as joining
# (agent_calls.MAX_OPENING): an agent says so at once; one that does not (slow, or holding
# places on purpose) must not keep others out. After a restart of 10,000 simulated agents,
# the first 64 taken held every place for 20 s while their simulators were busy.
JOIN_S = 1.0


@dataclasses.dataclass(eq=False)
class Link:
    """One machine's stream. `offer` is what it can hold while it waits for work; None while
    it runs a task (or before it said it is ready)."""

    machine_id: str
    outbox: asyncio.Queue[pb.CoordinatorEvent | None]
    offer: MachineView | None = None
    hold_kinds: bool = True
    since: float = dataclasses.field(default_factory=time.monotonic)
    heard: str = ""  # what its heartbeats stored (machines.said_digest): written when it changes
    shape: tuple[Any, ...] = ()  # shape(offer), made once as it says it is ready
    joined: bool = False  # no longer counted as joining (Fleet._joined)

    def close(self, why: str) -> None:
        self.outbox.put_nowait(pb.CoordinatorEvent(closing=why))
        self.outbox.put_nowait(None)


def shape(offer: MachineView) -> tuple[Any, ...]:
    """What decides which jobs a machine can be offered, but for its id: machines of one
    shape get the same answer from a claim (refusals and replicas aside)."""
    gpus = tuple(sorted((g.kind, g.name, g.free_mb, g.cc) for g in offer.gpus))
    return (gpus, offer.gpu_isolation, offer.enforced, offer.shares, offer.cpus,
            offer.memory_mb, offer.disk_mb)


class Fleet:
    """The links of this process, and its dispatcher (a task on the server's event loop)."""

    def __init__(self, leasing: LeaseService, machines: MachineService, work: Wakeup,
                 blocking: Executor, reply: Callable[[Lease, str, bool], pb.LeaseReply],
                 on_leased: Callable[[Lease, float], None] = lambda lease, took: None) -> None:
        """`reply`: the LeaseReply for a lease (lease, machine, hold_kinds), as Lease answers;
        `on_leased`: told of each lease delivered, with how long its claim took."""
        self.leasing, self.machines, self.work, self.blocking = leasing, machines, work, blocking
        self.reply, self.on_leased = reply, on_leased
        self.links: dict[str, Link] = {}
        self._kick: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn = itertools.count()  # rotates which machine of a group is tried first
        self._epoch = -1
        self.rounds = 0  # dispatch rounds run (for tests and the bench)
        # The last round found nothing queued, and no news of work came since: a machine
        # that says it is ready then waits for news (or the next look) instead of a round.
        # (Thousands of machines joining at once, after a restart, would each cost a round.)
        self._nothing_queued = False
        self._news = 0  # counts the wakes (news of work), read around a round
        self.joining = 0  # links whose machine has not said it is ready yet
        self.joined: Callable[[], None] = lambda: None  # told as `joining` goes down
        self.process = str(uuid.uuid4())  # this process, as the machines' rows name it
        # The machines that connected (True) or left (False) since the last SEEN_S write.
        self._changed: dict[str, bool] = {}

    # --- the streams ----------------------------------------------------------------------

    def connect(self, machine_id: str) -> Link:
        """A new stream for this machine; an older one of the same machine is closed."""
        old = self.links.pop(machine_id, None)
        if old is not None:
            old.close("this machine connected again")
        link = Link(machine_id, asyncio.Queue())
        self.links[machine_id] = link
        self._changed[machine_id] = True
        self.joining += 1
        asyncio.get_running_loop().call_later(JOIN_S, self._joined, link)
        return link

    def disconnect(self, link: Link) -> None:
        """The stream's call ended (every stream ends here, whoever ended it)."""
        current = self.links.get(link.machine_id)
        if current is link:
            del self.links[link.machine_id]
        if current is None or current is link:  # else it connected again meanwhile
            self._changed[link.machine_id] = False
        self._joined(link)

    def ready(self, link: Link, offer: MachineView, hold_kinds: bool) -> None:
        link.offer, link.hold_kinds, link.shape = offer, hold_kinds, shape(offer)
        self._joined(link)
        if not self._nothing_queued:  # else a machine joining costs no round: see _rounds
            self.kick()

    def _joined(self, link: Link) -> None:
        """The link no longer counts as joining: its machine said it is ready, its stream
        ended, or JOIN_S passed."""
        if not link.joined:
            link.joined = True
            self.joining -= 1
            self.joined()

    def end(self, link: Link, why: str) -> None:
        """End this stream (from the loop), if it is still its machine's."""
        if self.links.get(link.machine_id) is link:
            del self.links[link.machine_id]
        link.close(why)

    def close(self, machine_id: str, why: str) -> None:
        """End a machine's stream (from any thread): revoked, quarantined."""
        def now() -> None:
            link = self.links.pop(machine_id, None)
            if link is not None:
                link.close(why)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(now)

    def kick(self) -> None:
        """Work may have come: a round soon (from the loop)."""
        if self._kick is not None:
            self._kick.set()

    # --- the dispatcher -------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds, whenever kicked and every RECHECK_S, until cancelled."""
        self._loop, self._kick = asyncio.get_running_loop(), asyncio.Event()
        loop, kick = self._loop, self._kick

        def news() -> None:
            self._news += 1
            self._nothing_queued = False
            kick.set()

        def woken() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(news)

        self.work.listeners.append(woken)
        try:
            await self._rounds(kick)
        finally:
            self.work.listeners.remove(woken)
            for link in list(self.links.values()):
                link.close("the coordinator process is stopping")

    async def _rounds(self, kick: asyncio.Event) -> None:
        looked_at = time.monotonic()
        seen_at = looked_at - SEEN_S  # alive from the start
        seeing: asyncio.Future[None] | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kick.wait(), RECHECK_S)
            kick.clear()
            try:  # a database that is down for a moment must not end the dispatcher
                if time.monotonic() - looked_at >= RECHECK_S:
                    looked_at = time.monotonic()
                    await self._housekeeping()
                if time.monotonic() - seen_at >= SEEN_S and (self.links or self._changed) and (
                        seeing is None or seeing.done()):  # beside the rounds, not in their way
                    seen_at = time.monotonic()
                    seeing = asyncio.ensure_future(self._alive())
                idle = [(link, link.offer, link.shape) for link in self.links.values()
                        if link.offer is not None]
                if not idle:
                    continue
                before = self._news
                leased, queued = await self._blocking(self._round, idle)
                self._nothing_queued = not queued and self._news == before
            except Exception:
                log.exception("dispatch round")
                continue
            # After the round, all at once: sent while it still claims, each lease's machine
            # says it is ready again in the middle of the claims, and a burst of 200 queued
            # jobs went out at 460 leases/s instead of 740 (bench/fleet.py, 1,000 agents).
            for link, lease, took in leased:
                self._deliver(link, lease, took)

    def _round(self, idle: list[tuple[Link, MachineView, tuple[Any, ...]]]
               ) -> tuple[list[tuple[Link, Lease, float]], bool]:
        """One dispatch round (on a thread): claims for idle machines, group by group; and
        whether anything was queued."""
        self.rounds += 1
        demand = self.leasing.store.queued_demand(DEMAND_ROWS)
        if not demand:
            return [], False
        # No more claims than the work read queued can take (work queued since wakes another
        # round), unless the read stopped at DEMAND_ROWS.
        queued = sum(demand.values())
        bound = queued if queued < DEMAND_ROWS else len(idle)
        groups: dict[tuple[Any, ...], list[tuple[Link, MachineView]]] = {}
        for link, offer, key in idle:
            groups.setdefault(key, []).append((link, offer))
        leased: list[tuple[Link, Lease, float]] = []
        for members in groups.values():
            if not any(may_hold(need, members[0][1]) for need in demand):
                continue  # nothing queued is for these machines: no claim asks the database
            start = next(self._turn) % len(members)
            misses = 0
            for link, offer in itertools.chain(members[start:], members[:start]):
                if len(leased) >= bound:
                    return leased, True
                if self.machines.get(link.machine_id).status is not Status.APPROVED:
                    continue
                lease, took = self.leasing.timed_lease(link.machine_id, offer)
                if lease is None:
                    misses += 1
                    if misses >= TRIES_PER_GROUP:
                        break
                    continue
                leased.append((link, lease, took))
        return leased, True

    def _deliver(self, link: Link, lease: Lease, took: float) -> None:
        """The lease down its machine's stream; handed back if the stream ended meanwhile."""
        if self.links.get(link.machine_id) is not link or link.offer is None:
            self.blocking.submit(self.leasing.holds.of(lease.hold).release,
                                 "the machine's stream ended before its lease reached it",
                                 failed=False)
            return
        link.offer = None
        link.outbox.put_nowait(pb.CoordinatorEvent(
            lease=self.reply(lease, link.machine_id, link.hold_kinds)))
        self.on_leased(lease, took)

    async def _housekeeping(self) -> None:
        """Close the streams of machines no longer approved (another process's revocation,
        a quarantine): read only when some machine's status changed."""
        if not self.links:
            return
        epoch = await self._blocking(self.machines.store.machines.epoch)
        if epoch == self._epoch:
            return
        self._epoch = epoch
        ids = list(self.links)
        gone = await self._blocking(self.machines.store.machines.not_approved, ids)
        for machine_id in gone:
            link = self.links.pop(machine_id, None)
            if link is not None:
                link.close("this machine is no longer approved")

    async def _alive(self) -> None:
        changed, self._changed = self._changed, {}
        try:
            await self._blocking(self.machines.store.machines.alive, self.process, changed)
        except Exception:
            log.exception("writing that this process and its machines are alive")
            for machine_id, connected in changed.items():  # written next time, unless
                self._changed.setdefault(machine_id, connected)  # they came or went since

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self.blocking, fn, *args)

    def idle(self) -> Iterator[str]:
        """The machines waiting for work now; read from any thread (the links change on the
        server's loop: a copy that one of its changes got in the way of is made again)."""
        while True:
            try:
                links = self.links.copy()
            except RuntimeError:
                continue
            return (m for m, link in links.items() if link.offer is not None)
