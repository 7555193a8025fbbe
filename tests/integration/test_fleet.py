"""Idle machines on a stream (AgentService.Connect, coordinator/fleet.py), driven by the
agent's own link (campugrid.agent.link) against a real coordinator (SQLite, SeaweedFS): work
reaches a waiting machine without it asking again, a busy machine gets no more until it says
it is ready, idle streams cost the database nothing per machine, and a stream is signed,
bound to its machine and closed when the machine is revoked."""

from __future__ import annotations

import asyncio
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
from campugrid.coordinator import fleet, server
from campugrid.coordinator.db import STATEMENTS
from campugrid.coordinator.fleet import Fleet
from campugrid.coordinator.models import Machine
from campugrid.coordinator.views import utcnow
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER
from tests.support.coordinator import client, with_api
from tests.support.streams import OFFER, link_of, run, running_fleet, wait_until

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    with with_api(s3_server, tmp_path, "f") as running:
        yield running


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
