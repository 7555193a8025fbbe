"""Idle machines on a stream (AgentService.Connect, coordinator/fleet.py), driven by the
agent's own link (campugrid.agent.link) against a real coordinator (SQLite, SeaweedFS): work
reaches a waiting machine without it asking again, a busy machine gets no more until it says
it is ready, idle streams cost the database nothing per machine, and a stream is signed,
bound to its machine and closed when the machine is revoked."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import select, update

from campugrid.agent.client import CHANNEL_OPTIONS, CoordinatorClient
from campugrid.agent.link import CONNECT, Closed, Link, Waiting
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, tar_folder
from campugrid.coordinator import agent_calls, fleet, server
from campugrid.coordinator.db import STATEMENTS
from campugrid.coordinator.fleet import Fleet
from campugrid.coordinator.models import Machine
from campugrid.coordinator.views import utcnow
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER
from tests.support.coordinator import client, with_api

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
OFFER = pb.LeaseRequest(hold_kinds=True, cpus=4, memory_mb=8192, disk_mb=50_000)


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    with with_api(s3_server, tmp_path, "f") as running:
        yield running


def link_of(running: server.Running, c: CoordinatorClient,
            key: keys.Ed25519PrivateKey | None = None) -> Link:
    return Link(running.grpc_address, running.certificate.pem.decode(), key or c.key,
                c.machine_id)


def run(coroutine):  # each test's own loop
    return asyncio.run(coroutine)


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_work_reaches_a_waiting_machine_and_a_busy_one_gets_no_more_until_ready(coordinator, tmp_path):
    running, api = coordinator
    m = client(running, tmp_path, "m")

    async def scenario() -> tuple[pb.LeaseReply, float, bool]:
        link = link_of(running, m)
        await link.open()
        await link.ready(OFFER)
        await asyncio.sleep(0.3)  # connected and idle: nothing queued yet
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(None, lambda: api.submit(tar_folder(HELLO), JobSpec()))
        submitted = time.monotonic()
        got = await asyncio.wait_for(link.lease(), 10)
        took = time.monotonic() - submitted
        second = await loop.run_in_executor(None, lambda: api.submit(tar_folder(HELLO), JobSpec()))
        try:  # busy: the second job waits
            await asyncio.wait_for(link.lease(), 1.5)
            early = True
        except TimeoutError:
            early = False
        await link.ready(OFFER)
        again = await asyncio.wait_for(link.lease(), 10)
        await link.close()
        assert got.job_id == first["id"] and again.job_id == second["id"]
        return got, took, early

    got, took, early = run(scenario())
    assert not early, "a busy machine was sent a second lease"
    assert got.has_task and got.fencing_token == 1 and got.context_url
    assert took < 5
    job = api.job(got.job_id)
    assert job["state"] == "building" and job["machine_id"] == m.machine_id
    # The lease works like one asked for: it renews.
    renewed = m.stub.Renew(pb.RenewRequest(job_id=got.job_id, fencing_token=got.fencing_token,
                                           hold_kind=got.hold_kind, phase="building"), timeout=10)
    assert renewed.keep_going


def test_idle_streams_cost_the_database_nothing_per_machine(coordinator, tmp_path):
    """Twenty machines that each offer something else (as real ones do: their own free
    memory), and a job queued that none of them can hold: the dispatcher's rounds read the
    queue and claim for none of them."""
    running, api = coordinator
    machines = [client(running, tmp_path, f"m{i}") for i in range(20)]
    window = fleet.RECHECK_S + 0.5  # a round of its own falls in it

    def statements_over(seconds: float) -> int:
        before = STATEMENTS.count
        time.sleep(seconds)
        return STATEMENTS.count - before

    alone = statements_over(window)  # the coordinator's own (its reaper) with no machine

    async def idle() -> int:
        links = [link_of(running, c) for c in machines]
        for i, link in enumerate(links):
            await link.open()
            await link.ready(pb.LeaseRequest(hold_kinds=True, cpus=4, memory_mb=8192 + i,
                                             disk_mb=50_000))
        await asyncio.get_running_loop().run_in_executor(None, lambda: api.submit(
            tar_folder(HELLO), JobSpec.from_dict({"resources": {"cpus": 64}})))
        await asyncio.sleep(1.0)  # each ready and the submit woke a round: let them pass
        loop = asyncio.get_running_loop()
        counted = await loop.run_in_executor(None, statements_over, window)
        for link in links:
            await link.close()
        return counted

    connected = run(idle())
    # Twenty machines asking every second would be over 100 asks and 200 statements; a claim
    # tried for each would be 20 or more a round.
    assert connected - alone <= 10, (alone, connected)


@pytest.fixture
def looks_only_when_told(monkeypatch):
    monkeypatch.setattr(fleet, "RECHECK_S", 60.0)  # no round of the dispatcher's own


def test_machines_joining_while_nothing_is_queued_cost_no_round(looks_only_when_told,
                                                                coordinator, tmp_path):
    """After a round found nothing queued, machines that connect and say they are ready wait
    for news of work (thousands of them come back at once after a restart); the news still
    reaches them."""
    running, api = coordinator
    dispatcher = running_fleet(running)
    machines = [client(running, tmp_path, f"m{i}") for i in range(6)]

    async def scenario() -> tuple[int, int, list[pb.LeaseReply]]:
        links = [link_of(running, c) for c in machines]
        await links[0].open()
        await links[0].ready(OFFER)
        while dispatcher.rounds == 0:  # its ready's round: nothing queued
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        before = dispatcher.rounds
        for link in links[1:]:
            await link.open()
            await link.ready(OFFER)
        while len(list(dispatcher.idle())) < len(links):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        joined = dispatcher.rounds
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: api.submit(tar_folder(HELLO), JobSpec()))
        waits = [asyncio.ensure_future(link.lease()) for link in links]
        done, _ = await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for link in links:
            await link.close()
        return before, joined, [w.result() for w in done]

    claims = counted_claims(dispatcher)
    before, joined, got = run(scenario())
    assert joined == before, "machines joining ran rounds with nothing queued"
    assert len(got) == 1 and got[0].has_task
    # One job read queued, one claim: not a claim for each idle machine until some miss.
    assert claims == [True], claims


async def waiting_with_nothing_queued(running: server.Running, dispatcher: Fleet,
                                      machines: list[CoordinatorClient]) -> list[Link]:
    """These machines' streams, each ready for work, once the round their readiness woke
    has found nothing queued."""
    links = [link_of(running, c) for c in machines]
    for link in links:
        await link.open()
        await link.ready(OFFER)
    while len(list(dispatcher.idle())) < len(links) or dispatcher.rounds == 0:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    return links


def counted_claims(dispatcher: Fleet) -> list[bool]:
    """Each claim the dispatcher tries from now on: whether it found work."""
    tried: list[bool] = []
    real = dispatcher.leasing.timed_lease

    def counting(machine_id, offer=None):
        lease, took = real(machine_id, offer)
        tried.append(lease is not None)
        return lease, took

    dispatcher.leasing.timed_lease = counting  # type: ignore[method-assign]
    return tried


def test_a_sharded_job_spreads_over_the_idle_machines_in_one_round(looks_only_when_told,
                                                                    coordinator, tmp_path):
    """A round claims no more than the work it read queued can take, and a sharded job of
    three shards can take three machines: all three get a lease at once, not one a round."""
    running, _ = coordinator
    dispatcher = running_fleet(running)
    machines = [client(running, tmp_path, f"m{i}") for i in range(3)]

    async def scenario() -> list[pb.LeaseReply]:
        links = await waiting_with_nothing_queued(running, dispatcher, machines)
        dispatcher.leasing.store.submit(JobSpec.from_dict(
            {"command": ["x"], "shards": [{"payload": i} for i in range(3)]}),
            "contexts/x.tar", "ab" * 32)
        dispatcher.work.notify()
        waits = [asyncio.ensure_future(link.lease()) for link in links]
        await asyncio.wait(waits, timeout=5)  # the next round of its own is 60 s away
        for link in links:
            await link.close()
        return [w.result() for w in waits if w.done()]

    got = run(scenario())
    assert len(got) == 3 and len({g.job_id for g in got}) == 1, got


def test_a_stream_is_signed_by_an_approved_machine_and_closed_when_it_is_revoked(coordinator,
                                                                                 tmp_path):
    running, api = coordinator
    m = client(running, tmp_path, "m")
    pending = client(running, tmp_path, "pending", approve=False)
    stranger = keys.Ed25519PrivateKey.generate()

    async def refused(link: Link) -> Closed:
        with pytest.raises(Closed) as err:
            await link.open()  # the refusal is read before the agent writes anything
        await link.close()
        return err.value

    # Another key claiming to be m; an approved machine's stream unsigned; a pending one.
    forged = run(refused(link_of(running, m, key=stranger)))
    assert forged.code == grpc.StatusCode.UNAUTHENTICATED and "signature" in forged.reason
    waiting = run(refused(link_of(running, pending)))
    assert waiting.code == grpc.StatusCode.PERMISSION_DENIED and "pending" in waiting.reason

    async def unsigned() -> grpc.StatusCode:
        credentials = grpc.ssl_channel_credentials(running.certificate.pem)
        async with grpc.aio.secure_channel(running.grpc_address, credentials,
                                           options=list(CHANNEL_OPTIONS)) as ch:
            call = ch.stream_stream(CONNECT, request_serializer=pb.AgentEvent.SerializeToString,
                                    response_deserializer=pb.CoordinatorEvent.FromString)(
                metadata=[(MACHINE_HEADER, m.machine_id)])
            try:
                await call.read()
            except grpc.aio.AioRpcError as e:
                return e.code()
            return await call.code()

    assert run(unsigned()) == grpc.StatusCode.UNAUTHENTICATED

    async def revoked() -> str:
        link = link_of(running, m)
        await link.open()
        await link.ready(OFFER)
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        await loop.run_in_executor(None, running.coord.machines.revoke, m.machine_id)
        with pytest.raises(Closed) as err:
            await asyncio.wait_for(link.lease(), 5)
        assert time.monotonic() - began < 2  # at once, not at the next look
        await link.close()
        return err.value.reason

    assert "revoked" in run(revoked())
    # It cannot open another, and nothing is claimed for it: a job submitted now waits.
    again = run(refused(link_of(running, m)))
    assert again.code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in again.reason
    job = api.submit(tar_folder(HELLO), JobSpec())  # the submit wakes the dispatcher at once
    time.sleep(1.0)
    assert api.job(job["id"])["state"] == "queued" and not list(running_fleet(running).idle())


def test_the_agents_client_waits_on_its_stream_and_heartbeats_on_it(coordinator, tmp_path):
    """What worker.py calls (CoordinatorClient.lease with a wait, heartbeat) goes over the
    stream: no Lease call is held, the heartbeat's capabilities arrive, the lease is a lease."""
    running, api = coordinator
    m = client(running, tmp_path, "m")
    m.heartbeat(pb.Capabilities(runtime="runsc go-stream-test", builder="buildah", cpus=4))
    wait_until(lambda: "go-stream-test" in str(running.coord.machines.all()))
    got: list[pb.LeaseReply] = []
    asking = threading.Thread(target=lambda: got.append(m.lease(wait_s=15, room=(4, 8192, 50_000))))
    asking.start()
    wait_until(lambda: any(True for _ in running_fleet(running).idle()))
    job = api.submit(tar_folder(HELLO), JobSpec())
    asking.join(10)
    assert got and got[0].has_task and got[0].job_id == job["id"]
    # Given up early, a wait returns nothing and claims nothing.
    quit_waiting = threading.Event()
    later: list[pb.LeaseReply] = []
    asking = threading.Thread(target=lambda: later.append(m.lease(
        wait_s=15, give_up=quit_waiting.is_set, room=(4, 8192, 50_000))))
    asking.start()
    time.sleep(0.5)
    quit_waiting.set()
    asking.join(5)
    assert later and not later[0].has_task
    # On the stream, a heartbeat that says nothing new is not sent again within a minute;
    # a changed one is.
    beat = pb.Capabilities(runtime="runsc go-stream-test-2", builder="buildah", cpus=4)
    m.heartbeat(beat)
    wait_until(lambda: "go-stream-test-2" in str(running.coord.machines.all()))
    sent = m.waiting._beat
    m.heartbeat(beat)
    assert m.waiting._beat is sent
    m.heartbeat(pb.Capabilities(runtime="runsc go-stream-test-3", builder="buildah", cpus=4))
    wait_until(lambda: "go-stream-test-3" in str(running.coord.machines.all()))


def test_a_machine_that_connects_again_saying_the_same_costs_no_write(coordinator, tmp_path,
                                                                       monkeypatch):
    """After a coordinator restart thousands of machines connect again, each saying what it
    said before: only what differs from what is stored is written (bench/fleet.py's restart)."""
    running, _ = coordinator
    m = client(running, tmp_path, "m")
    said = pb.Capabilities(runtime="runsc same-again", builder="buildah", cpus=4)
    store = running.coord.machines.store.machines
    writes: list[str] = []
    write = store.heartbeat
    monkeypatch.setattr(store, "heartbeat", lambda machine, *a, **kw: (
        writes.append(machine), write(machine, *a, **kw)))

    async def connected(capabilities: pb.Capabilities) -> None:
        link = link_of(running, m)
        await link.open()
        await link.heartbeat(capabilities)
        await link.ready(OFFER)
        await asyncio.sleep(0.5)
        await link.close()

    run(connected(said))
    assert writes == [m.machine_id] and "same-again" in str(running.coord.machines.all())
    run(connected(said))  # the same again: nothing to write
    assert writes == [m.machine_id]
    run(connected(pb.Capabilities(runtime="runsc said-otherwise", builder="buildah", cpus=4)))
    assert writes == [m.machine_id] * 2 and "said-otherwise" in str(running.coord.machines.all())
    # What a machine said is what is stored, not what this process last heard: the record
    # read after a restart (here: forgotten) still tells the same from a change.
    running.coord.machines._records.forget(m.machine_id)
    run(connected(said))
    assert writes == [m.machine_id] * 3 and "same-again" in str(running.coord.machines.all())


def running_fleet(running: server.Running) -> Fleet:
    assert running.service is not None
    return running.service.fleet


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


def test_idle_machines_are_seen_through_their_process_not_written_one_by_one(coordinator,
                                                                             tmp_path, monkeypatch):
    """Every SEEN_S the process says it is alive (one row) and names the machines that came
    or went since; a machine that stays connected is not written again, and stays online."""
    monkeypatch.setattr(fleet, "SEEN_S", 0.3)
    monkeypatch.setattr(fleet, "RECHECK_S", 0.3)
    running, _ = coordinator
    dispatcher = running_fleet(running)
    machines = [client(running, tmp_path, f"m{i}") for i in range(3)]
    ids = {c.machine_id for c in machines}
    store = running.coord.machines.store.machines

    def rows() -> dict[str, tuple[str | None, dt.datetime]]:
        with store.db.read() as s:
            return {m.id: (m.connected_to, m.last_seen_at) for m in s.scalars(
                select(Machine).where(Machine.id.in_(ids)))}

    async def scenario() -> None:
        links = [link_of(running, c) for c in machines]
        for link in links:
            await link.open()
            await link.ready(OFFER)
        await asyncio.to_thread(wait_until, lambda: all(
            to == dispatcher.process for to, _ in rows().values()))
        long_ago = utcnow() - dt.timedelta(hours=1)
        with store.db.tx() as s:  # connected an hour ago
            s.execute(update(Machine).where(Machine.id.in_(ids)).values(last_seen_at=long_ago))
        await asyncio.sleep(1.0)  # three turns of SEEN_S
        assert {seen for _, seen in rows().values()} == {long_ago}  # not written again
        assert ids <= {m.id for m in store.online()}  # and online: its process is alive
        await links[0].close()
        await asyncio.to_thread(wait_until, lambda: rows()[machines[0].machine_id][0] is None)
        assert rows()[machines[0].machine_id][1] > long_ago + dt.timedelta(minutes=59)
        for link in links[1:]:
            await link.close()

    run(scenario())


def test_a_lost_stream_is_tried_again_after_a_jittered_backoff_that_grows():
    told = []
    waiting = Waiting(lambda: "127.0.0.1:1", "", keys.Ed25519PrivateKey.generate(), lambda: "m",
                      unreachable=lambda: told.append(1))
    tries = []
    for _ in range(8):
        before = time.monotonic()
        waiting._lost(Closed("gone", grpc.StatusCode.UNAVAILABLE))
        tries.append(waiting._next_try - before)
    assert all(0 <= t <= 30.5 for t in tries) and len({round(t, 3) for t in tries}) > 4
    assert waiting._backoff.limit == 30.0 and len(told) == 8  # the client moves to its next address
    # While the next try waits, a wait for work is that wait (up to its own), and no task.
    waiting._next_try = time.monotonic() + 0.8
    began = time.monotonic()
    assert waiting.wait(OFFER, 5, None) is None
    assert 0.7 <= time.monotonic() - began < 2


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


def test_a_stream_dropped_mid_lease_leaves_the_lease_to_its_renewals(coordinator, tmp_path):
    """The stream is for waiting: a machine whose connection drops after its lease came keeps
    the task (renewed and completed by its calls); the coordinator forgets the stream."""
    running, api = coordinator
    m = client(running, tmp_path, "m")
    fleet = running_fleet(running)

    async def leased_then_dropped() -> pb.LeaseReply:
        link = link_of(running, m)
        await link.open()
        await link.ready(OFFER)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: api.submit(tar_folder(HELLO), JobSpec()))
        got = await asyncio.wait_for(link.lease(), 10)
        await link.close()  # the connection drops
        return got

    got = run(leased_then_dropped())
    wait_until(lambda: m.machine_id not in fleet.links)
    hold = {"job_id": got.job_id, "fencing_token": got.fencing_token, "hold_kind": got.hold_kind}
    assert m.stub.Renew(pb.RenewRequest(**hold, phase="running"), timeout=10).keep_going
    done = m.stub.Complete(pb.CompleteRequest(**hold, succeeded=True, result="after the drop"),
                           timeout=10)
    assert done.accepted
    final = api.job(got.job_id)
    assert final["state"] == "succeeded" and final["result"] == "after the drop"


def test_a_serving_coordinator_freezes_its_imports_and_collects_rarely():
    """server.tune_gc, in a process of its own (it changes the whole process's collector):
    with 10,000 agents, full collections every 15 s held dispatches up to 0.8 s each
    (bench/fleet.py)."""
    code = ("import gc; from campugrid.coordinator import server; server.tune_gc(); "
            "print(gc.get_freeze_count(), *gc.get_threshold())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    frozen, thresholds = int(out[0]), tuple(int(x) for x in out[1:])
    assert frozen > 50_000  # the coordinator's imports: never walked again
    assert thresholds == server.GC_THRESHOLDS and thresholds[0] >= 10_000


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
