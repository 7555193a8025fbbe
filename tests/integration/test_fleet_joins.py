"""Joining a coordinator that is taking many streams at once (after a restart, thousands):
a stream waits in line for a place among the joins (agent_calls.MAX_OPENING), first come
first taken, if it is signed by a machine the process knows and the line is not full; past
that it is turned away and told when to come back (Admission), and comes back on the same
connection. A machine keeps its place for fleet.JOIN_S at most. Against a real coordinator
(SQLite, SeaweedFS), with the agent's own link."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from campugrid.agent.client import CoordinatorClient
from campugrid.agent.link import CONNECT, Closed
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api
from campugrid.coordinator import agent_calls, fleet, server
from campugrid.protocol import keys
from tests.support.coordinator import client, with_api
from tests.support.streams import OFFER, link_of, run, running_fleet, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    with with_api(s3_server, tmp_path, "j") as running:
        yield running


def heard_from(*clients: CoordinatorClient) -> None:
    """A signed call from each (a heartbeat): the process holds their records, and only a
    stream of a machine whose record it holds may wait in line."""
    for c in clients:
        c.heartbeat()


def one_place(coordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: str,
              join_s: float = 60.0) -> tuple[server.Running, list[CoordinatorClient],
                                             agent_calls.SignedCalls]:
    """One place to join at once (MAX_OPENING) and a line as long, and a machine for each
    name, all but the first heard from (they may wait in line)."""
    running, _ = coordinator
    machines = [client(running, tmp_path, n) for n in names]
    heard_from(*machines[1:])
    monkeypatch.setattr(agent_calls, "MAX_OPENING", 1)
    monkeypatch.setattr(agent_calls.Admission, "LINE_S", 0.0)
    monkeypatch.setattr(fleet, "JOIN_S", join_s)
    assert running.signed is not None
    return running, machines, running.signed


def test_a_coordinator_checking_many_streams_turns_one_away_to_try_again_later(
        coordinator, tmp_path, monkeypatch):
    """After a restart thousands of agents open streams at once: past MAX_OPENING being
    checked, one is refused at once and told when to come back, each turned-away stream a
    moment of its own, at the rate streams are being taken; the agent comes back then."""
    running, _ = coordinator
    m = client(running, tmp_path, "m")
    monkeypatch.setattr(agent_calls, "MAX_OPENING", 0)
    monkeypatch.setattr(agent_calls.Admission, "LINE_S", 0.0)  # no line to wait in
    # A moment every second: given at AHEAD times the floor's rate.
    monkeypatch.setattr(agent_calls.Admission, "FLOOR_PER_S", 1.0 / agent_calls.Admission.AHEAD)

    async def turned_away() -> Closed:
        link = link_of(running, m)
        with pytest.raises(Closed) as err:
            await link.open()
        await link.close()
        return err.value

    busy = [run(turned_away()) for _ in range(3)]
    assert all(b.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "try again" in b.reason
               for b in busy)
    # Each later one a moment further (none taken meanwhile: the floor's rate).
    assert [round(b.retry_after or 0) for b in busy] == [1, 2, 3], [b.retry_after for b in busy]
    began = time.monotonic()
    assert not m.lease(wait_s=1).has_task  # no grpc.RpcError: a wait, not a refusal
    told = m.waiting._next_try - began
    assert 3.5 < told < 4.5 and m.waiting._backoff.limit == 1.0, told  # as told, not doubled


def test_a_stream_whose_machine_has_not_said_it_is_ready_is_still_joining(coordinator, tmp_path,
                                                                           monkeypatch):
    """What bounds the joins at once is the whole join (checked, taken, ready), not the
    signature check alone: the rest of it is what crowds the server's loop after a restart.
    A stream that comes while there is no room waits in line and is taken as a machine
    joins; past the line, one is turned away."""
    running, (first, second, third), signed = one_place(coordinator, tmp_path, monkeypatch, "abc")

    async def scenario() -> tuple[Closed, bool, int]:
        a = link_of(running, first)
        await a.open()  # taken, not ready yet: joining
        b = link_of(running, second)
        waits = asyncio.ensure_future(b.open())  # no room: in line
        while not signed.waiting:
            await asyncio.sleep(0.02)
        c = link_of(running, third)
        with pytest.raises(Closed) as busy:
            await c.open()  # the line is full
        await c.close()
        taken_early = waits.done()
        await a.ready(OFFER)  # a has joined: room for b
        await asyncio.wait_for(waits, 10)
        await b.close()
        await a.close()
        await asyncio.sleep(0.3)
        return busy.value, taken_early, running_fleet(running).joining

    busy, taken_early, joining = run(scenario())
    assert not taken_early  # b waited for a to join
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "try again" in busy.reason, busy
    assert joining == 0  # b ended without saying it was ready: not joining any more
    assert signed.waiting == 0 and signed.opening == 0


def test_only_a_stream_signed_by_a_known_machine_waits_in_line(coordinator, tmp_path,
                                                               monkeypatch):
    """A place in line is held for seconds: one signed by another key (or by a machine the
    process holds no record of: not heard from lately) is turned away at once instead, told
    when to come back, and never takes the place of a machine."""
    running, (first, second), signed = one_place(coordinator, tmp_path, monkeypatch, "ab")

    async def scenario() -> tuple[Closed, int]:
        a = link_of(running, first)
        await a.open()  # taken, not ready: no room
        forged = link_of(running, second, keys.Ed25519PrivateKey.generate())  # b's id, not its key
        with pytest.raises(Closed) as turned_away:
            await asyncio.wait_for(forged.open(), 5)
        await forged.close()
        waiting_after = signed.waiting
        b = link_of(running, second)
        waits = asyncio.ensure_future(b.open())  # b itself waits
        while not signed.waiting:
            await asyncio.sleep(0.02)
        await a.ready(OFFER)
        await asyncio.wait_for(waits, 10)
        await b.close()
        await a.close()
        return turned_away.value, waiting_after

    turned_away, waiting_after = run(scenario())
    assert turned_away.code == grpc.StatusCode.RESOURCE_EXHAUSTED, turned_away
    assert waiting_after == 0


def test_a_machine_holds_one_place_in_line_at_most(coordinator, tmp_path, monkeypatch):
    """One machine's key cannot fill the line: a second stream it opens while its first waits
    is turned away, though the line has room for another machine's."""
    running, (first, second, third), signed = one_place(coordinator, tmp_path, monkeypatch, "abc")
    monkeypatch.setattr(agent_calls.Admission, "FLOOR_PER_S", 1.0)
    monkeypatch.setattr(agent_calls.Admission, "LINE_S", 2.0)  # a line of two

    async def scenario() -> Closed:
        a = link_of(running, first)
        await a.open()  # taken, not ready: no room
        b = link_of(running, second)
        waits = [asyncio.ensure_future(b.open())]
        while signed.waiting < 1:
            await asyncio.sleep(0.02)
        again = link_of(running, second)  # b's own key, a new nonce
        with pytest.raises(Closed) as turned_away:
            await asyncio.wait_for(again.open(), 5)
        await again.close()
        c = link_of(running, third)
        waits.append(asyncio.ensure_future(c.open()))  # room in line for another machine
        while signed.waiting < 2:
            await asyncio.sleep(0.02)
        await a.ready(OFFER)
        await asyncio.wait_for(waits[0], 10)
        await b.ready(OFFER)
        await asyncio.wait_for(waits[1], 10)
        for link in (a, b, c):
            await link.close()
        return turned_away.value

    turned_away = run(scenario())
    assert turned_away.code == grpc.StatusCode.RESOURCE_EXHAUSTED, turned_away
    assert signed.waiting == 0 and not signed._in_line


def test_a_machine_that_does_not_say_it_is_ready_holds_its_place_for_join_s_only(
        coordinator, tmp_path, monkeypatch):
    """One that never says so (slow, or keeping others out on purpose) stops counting as
    joining after JOIN_S: the next in line is taken then, its own stream still open."""
    running, (first, second), _ = one_place(coordinator, tmp_path, monkeypatch, "ab", join_s=1.0)

    async def scenario() -> float:
        a = link_of(running, first)
        await a.open()  # taken; says nothing
        began = time.monotonic()
        b = link_of(running, second)
        await asyncio.wait_for(b.open(), 10)  # in line until a's JOIN_S
        waited = time.monotonic() - began
        assert first.machine_id in running_fleet(running).links  # a's stream stays
        await b.close()
        await a.close()
        return waited

    assert 0.7 < run(scenario()) < 5


def test_a_stream_that_gives_up_in_line_leaves_it(coordinator, tmp_path, monkeypatch):
    """An agent that stops waiting (its OPEN_S, or it stops) is out of the line: the room
    goes to the next one, and none is counted for it."""
    running, (first, second, third), signed = one_place(coordinator, tmp_path, monkeypatch, "abc")

    async def scenario() -> None:
        a = link_of(running, first)
        await a.open()
        b = link_of(running, second)
        waits = asyncio.ensure_future(b.open())
        while not signed.waiting:
            await asyncio.sleep(0.02)
        waits.cancel()  # b gives up
        with contextlib.suppress(asyncio.CancelledError):
            await waits
        await b.close()
        while signed.waiting:
            await asyncio.sleep(0.02)
        c = link_of(running, third)
        third_waits = asyncio.ensure_future(c.open())  # the line has room again
        while not signed.waiting:
            await asyncio.sleep(0.02)
        await a.ready(OFFER)
        await asyncio.wait_for(third_waits, 10)  # taken as a joined, not b
        await c.close()
        await a.close()

    run(scenario())
    wait_until(lambda: signed.opening == 0 and signed.waiting == 0)


def _connections_to(port: int) -> set[int]:
    """The local ports of this host's established TCP connections to `port` (the clients'
    sides of them): /proc/net/tcp and tcp6."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_a_stream_turned_away_as_busy_is_tried_again_on_the_same_connection(
        coordinator, tmp_path, monkeypatch):
    """A refusal for being busy ends the stream, not the connection: the next try is a new
    stream on it. A new TLS connection for each try cost the coordinator several times more
    than the stream (bench/fleet.py's restart: 3.5 tries per agent)."""
    running, _ = coordinator
    m = client(running, tmp_path, "m")
    port = int(running.grpc_address.rpartition(":")[2])
    monkeypatch.setattr(agent_calls, "MAX_OPENING", 0)
    monkeypatch.setattr(agent_calls.Admission, "LINE_S", 0.0)  # no line to wait in
    monkeypatch.setattr(agent_calls.Admission, "FLOOR_PER_S", 10.0)  # come back in 50 ms
    before = _connections_to(port)
    assert not m.lease(wait_s=0.3).has_task  # turned away: a wait
    assert m.waiting._link is None
    turned_away = _connections_to(port) - before
    assert len(turned_away) == 1, turned_away  # the stream's connection, still open
    monkeypatch.setattr(agent_calls, "MAX_OPENING", 64)
    time.sleep(0.2)
    assert not m.lease(wait_s=0.3).has_task  # taken this time: nothing queued
    assert m.waiting._link is not None
    assert _connections_to(port) - before == turned_away  # the same connection
    m.waiting.close()


def test_a_stream_cancelled_before_it_was_taken_is_tried_again_on_the_same_connection(
        coordinator, tmp_path, monkeypatch):
    """gRPC cancels a call that waited longer than its server keeps calls the handlers have
    not taken up (30 s: thousands of agents coming back at once after a restart). The
    connection works: the next try is a new stream on it, as after a refusal for being busy.
    (A new TLS connection for each of those tries was what kept a restart of 10,000 agents
    from getting anywhere for 40 s: bench/fleet.py.)"""
    running, _ = coordinator
    m = client(running, tmp_path, "m")
    port = int(running.grpc_address.rpartition(":")[2])
    checked = agent_calls.SignedCalls._check

    def cancelled(self: agent_calls.SignedCalls, method: str, digest: str, context: object) -> object:
        if method == CONNECT:  # as gRPC ends a call it dropped from its queue: CANCELLED
            context.abort(grpc.StatusCode.CANCELLED, "")  # type: ignore[attr-defined]
        return checked(self, method, digest, context)  # type: ignore[arg-type]

    monkeypatch.setattr(agent_calls.SignedCalls, "_check", cancelled)
    before = _connections_to(port)
    assert not m.lease(wait_s=0.3).has_task  # cancelled: a wait, not an error
    assert m.waiting._link is None and m.waiting._kept is not None
    kept = _connections_to(port) - before
    assert len(kept) == 1, kept  # the stream's connection, still open
    monkeypatch.setattr(agent_calls.SignedCalls, "_check", checked)
    m.waiting._next_try = 0.0  # (its jittered backoff is another test's)
    assert not m.lease(wait_s=0.3).has_task  # taken this time: nothing queued
    assert m.waiting._link is not None
    assert _connections_to(port) - before == kept  # the same connection
    m.waiting.close()
