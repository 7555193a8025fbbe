"""An idle agent's one connection to its coordinator (AgentService.Connect), on asyncio: it
opens a stream once, says on it when the machine is ready for work and what a task can be
given there, sends its heartbeats, and receives leases as the coordinator claims work for
it, instead of asking for work every second. Many links share one event loop (bench/fleet.py
runs thousands in one process).

The stream is signed once, as it opens (campugrid.protocol.wire.STREAM_BODY), over the
pinned TLS channel (wire.CHANNEL_OPTIONS, as the agent's other calls, with a slower
keepalive); every message on it is this machine's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys
from campugrid.protocol.wire import (
    CHANNEL_OPTIONS,
    MACHINE_HEADER,
    RETRY_AFTER_HEADER,
    STREAM_BODY,
    STREAM_TAKEN,
    signed_metadata,
)

CONNECT = "/campugrid.v1.AgentService/Connect"
GIVE_UP_S = 0.5  # how often a wait asks whether the agent still wants work
OPEN_S = 20.0  # a coordinator that has not taken a stream by then is taken as unreachable
# An idle fleet's traffic is what costs its coordinator (bench/fleet.py): on a stream, a
# heartbeat that says nothing new is sent this often only (the open stream is what keeps the
# machine online: the coordinator writes every connected machine's "seen" itself), and the
# connection's keepalive pings come every KEEPALIVE_S rather than the unary channel's 10 s.
STREAM_BEAT_S = 60.0
KEEPALIVE_S = 30.0
STREAM_OPTIONS = tuple((k, int(KEEPALIVE_S * 1000)) if k == "grpc.keepalive_time_ms" else (k, v)
                       for k, v in CHANNEL_OPTIONS)
T = TypeVar("T")


class Closed(Exception):
    """The stream ended: `reason` is the coordinator's word (revoked, stopping) or the
    status the call ended with; `retry_after`, seconds, when the coordinator said when to
    try again (wire.RETRY_AFTER_HEADER)."""

    def __init__(self, reason: str, code: grpc.StatusCode | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason, self.code, self.retry_after = reason, code, retry_after


def _retry_after(metadata: Any) -> float | None:
    """What a refusal's trailing metadata says of when to try again (seconds, at most an
    hour), if it says."""
    for key, value in tuple(metadata or ()):
        if key == RETRY_AFTER_HEADER and isinstance(value, str) and value.isdigit():
            return min(int(value), 3_600_000) / 1000
    return None


class Link:
    def __init__(self, address: str, certificate: str, key: keys.Ed25519PrivateKey,
                 machine_id: str) -> None:
        self.address, self.certificate = address, certificate
        self.key, self.machine_id = key, machine_id
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        # What the stream brought, read by a task of its own: a wait for a lease may be
        # given up (a timeout) without ending the call, as a cancelled read would.
        self._events: asyncio.Queue[pb.LeaseReply | Closed] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """A new stream, on this link's connection (made by the first `open`, and kept when
        the coordinator turned the stream away for being busy: see `end`)."""
        if self._channel is None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self.certificate.encode())
            self._channel = grpc.aio.secure_channel(self.address, credentials,
                                                    options=list(STREAM_OPTIONS))
        self._events = asyncio.Queue()
        connect = self._channel.stream_stream(
            CONNECT, request_serializer=pb.AgentEvent.SerializeToString,
            response_deserializer=pb.CoordinatorEvent.FromString)
        self._call = connect(metadata=[(MACHINE_HEADER, self.machine_id), *signed_metadata(
            self.key, CONNECT, STREAM_BODY, self.machine_id)])
        # Nothing is written before the coordinator says it took the stream: a refusal
        # (a pending or revoked machine, a bad signature) is then read whole.
        try:
            said = await asyncio.wait_for(self._call.initial_metadata(), OPEN_S)
        except grpc.aio.AioRpcError as e:
            raise Closed(e.details() or e.code().name, e.code(),
                         _retry_after(e.trailing_metadata())) from e
        except TimeoutError as e:
            self._call.cancel()
            raise Closed(f"no answer in {OPEN_S:.0f} s", grpc.StatusCode.UNAVAILABLE) from e
        taken = STREAM_TAKEN in tuple(said or ())
        if not taken:
            raise Closed(await self._ended(), await self._call.code(),
                         _retry_after(await self._call.trailing_metadata()))
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def ready(self, offer: pb.LeaseRequest) -> None:
        """Ready for work: what a task can be given here (LeaseRequest's fields)."""
        await self._write(pb.AgentEvent(ready=offer))

    async def heartbeat(self, capabilities: pb.Capabilities | None) -> None:
        await self._write(pb.AgentEvent(heartbeat=pb.HeartbeatRequest(capabilities=capabilities)
                                        if capabilities is not None else pb.HeartbeatRequest()))

    async def lease(self) -> pb.LeaseReply:
        """The next lease the coordinator sends (the machine is busy from then on, until it
        says it is ready again). Raises Closed when the stream ends; may be cancelled (a
        timeout) without ending it."""
        event = await self._events.get()
        if isinstance(event, Closed):
            self._events.put_nowait(event)  # and to every later ask
            raise event
        return event

    async def _read(self) -> None:
        assert self._call is not None
        try:
            while True:
                event = await self._call.read()
                if event is grpc.aio.EOF:
                    self._events.put_nowait(Closed(await self._ended()))
                    return
                if event.HasField("closing"):
                    self._events.put_nowait(Closed(event.closing))
                    return
                self._events.put_nowait(event.lease)
        except grpc.aio.AioRpcError as e:
            self._events.put_nowait(Closed(e.details() or e.code().name, e.code()))
        except asyncio.CancelledError:
            self._events.put_nowait(Closed("closed by this agent"))
            raise

    async def end(self) -> None:
        """End this stream and keep the connection for the next `open`: after a stream was
        turned away (TURNED_AWAY) the next try is a new stream on it, not a new TLS
        connection, which costs the coordinator (and the agent) several times more."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        await self.end()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _write(self, event: pb.AgentEvent) -> None:
        assert self._call is not None, "open() first"
        try:
            await self._call.write(event)
        except grpc.aio.AioRpcError as e:
            raise Closed(e.details() or e.code().name, e.code()) from e
        except asyncio.InvalidStateError as e:  # written after the call ended
            raise Closed(await self._ended(), await self._call.code()) from e

    async def _ended(self) -> str:
        assert self._call is not None
        code = await self._call.code()
        return str(await self._call.details() or code.name)


class Refused(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """The coordinator refused this machine's stream (not approved yet, revoked, a signature
    it does not take): what the worker hears as it would from any refused call."""

    def __init__(self, closed: Closed) -> None:
        super().__init__(closed.reason)
        self._code = closed.code or grpc.StatusCode.PERMISSION_DENIED
        self._details = closed.reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


REFUSALS = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED  # turned away for now, told when to come back
# A stream turned away before it was taken, over a connection that works: the coordinator
# was busy (BUSY: ours, or gRPC's own "too many pending requests"), or gRPC cancelled the
# call after it waited longer than the server keeps calls its handlers have not taken up
# yet (CANCELLED; 30 s, when thousands come back at once after a restart). The next try is
# a new stream on the same connection (Link.end), not a new TLS connection.
TURNED_AWAY = frozenset({BUSY, grpc.StatusCode.CANCELLED})
BACKOFF_S, BACKOFF_MAX_S = 1.0, 30.0


class Backoff:
    """When to try a stream again after it ended or did not open. Where the coordinator said
    when (it was taking many streams at once, and gave this one a moment of its own), then,
    give or take a tenth; else a random time in [0, limit], the limit doubling from BACKOFF_S
    up to BACKOFF_MAX_S, so that a coordinator restarting with thousands of agents connected
    gets them back spread out, not all at once. A lease resets it."""

    def __init__(self) -> None:
        self.limit = BACKOFF_S

    def after(self, closed: Closed) -> float:
        if closed.retry_after is not None:
            return closed.retry_after * random.uniform(0.95, 1.05)  # noqa: S311 - jitter
        wait = random.uniform(0, self.limit)  # noqa: S311 - jitter
        self.limit = min(BACKOFF_MAX_S, self.limit * 2)
        return wait

    def reset(self) -> None:
        self.limit = BACKOFF_S


class Waiting:
    """A Link for the agent's threads (client.CoordinatorClient.lease and heartbeat): the
    link lives on an event loop of its own, opened when first wanted and again after it
    ends (with a jittered backoff); `ready` is sent when the machine becomes idle or what it
    offers changed, and `wait` returns the next lease. `unreachable` is told when the
    coordinator could not be reached (the client moves on to its next address)."""

    def __init__(self, address: Callable[[], str], certificate: str,
                 key: keys.Ed25519PrivateKey, machine_id: Callable[[], str],
                 unreachable: Callable[[], None] = lambda: None) -> None:
        self.address, self.certificate, self.key, self.machine_id = (
            address, certificate, key, machine_id)
        self.unreachable = unreachable
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._link: Link | None = None
        self._kept: Link | None = None  # a turned-away stream's link: its connection stays
        self._offered: pb.LeaseRequest | None = None  # the last `ready` sent on this link
        self._next_try = 0.0
        self._backoff = Backoff()
        self._beat: tuple[bytes, float] | None = None  # the last heartbeat sent, and when
        self._lock = threading.Lock()

    def wait(self, offer: pb.LeaseRequest, wait_s: float,
             give_up: Callable[[], bool] | None) -> pb.LeaseReply | None:
        """The next lease within `wait_s`; None when none came, `give_up` said so, or there
        is no stream now (the wait is then the stream's backoff, up to `wait_s`). Raises
        Refused when the coordinator refuses this machine's stream."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            try:
                link = self._open()
                if link is None:
                    self._pause(min(deadline, self._next_try), give_up)
                    return None
                if self._offered != offer:
                    self._run(link.ready(offer), 30)
                    self._offered = offer
                pending = asyncio.run_coroutine_threadsafe(link.lease(), self._started())
                while True:
                    try:
                        reply = pending.result(timeout=min(GIVE_UP_S, max(0.0, deadline - time.monotonic())))
                    except concurrent.futures.TimeoutError:
                        over = time.monotonic() >= deadline or (give_up is not None and give_up())
                        if over and pending.cancel():
                            return None
                        continue  # still waiting, or it came meanwhile: take it
                    self._offered = None  # busy: ready again once the task is done
                    self._backoff.reset()
                    return reply
            except Closed as e:
                self._lost(e)
                if e.code in REFUSALS:
                    raise Refused(e) from e
                self._pause(min(deadline, self._next_try), give_up)
                return None

    def heartbeat(self, capabilities: pb.Capabilities | None) -> bool:
        """Sent on the stream if one is open (True); else the caller calls Heartbeat."""
        with self._lock:
            if self._link is None:
                return False
            said = (capabilities.SerializeToString(deterministic=True)
                    if capabilities is not None else b"")
            now = time.monotonic()
            if self._beat is not None and self._beat[0] == said and now - self._beat[1] < STREAM_BEAT_S:
                return True  # nothing new, and the stream says the machine is there
            try:
                self._run(self._link.heartbeat(capabilities), 30)
            except Closed as e:
                self._lost(e)
                return False
            self._beat = (said, now)
            if capabilities is not None and capabilities.held:
                self._offered = None  # the coordinator took it as not ready; ready again later
            return True

    def close(self) -> None:
        with self._lock:
            for link in (self._link, self._kept):
                if link is not None:
                    self._run(link.close(), 10)
            self._link = self._kept = None
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                if self._thread is not None:
                    self._thread.join(10)
                if not self._loop.is_running():
                    self._loop.close()
                self._loop, self._thread = None, None

    def _open(self) -> Link | None:
        """The open link; None while the next try must wait (its backoff)."""
        if self._link is not None:
            return self._link
        if time.monotonic() < self._next_try or not self.machine_id():
            return None
        link, self._kept = self._kept, None
        if link is None or link.address != self.address():
            if link is not None:
                self._run(link.close(), 10)
            link = Link(self.address(), self.certificate, self.key, self.machine_id())
        try:
            self._run(link.open(), 30)
        except Closed as e:
            if e.code in TURNED_AWAY:
                self._run(link.end(), 10)
                self._kept = link
            else:
                self._run(link.close(), 10)
            raise
        self._link, self._offered, self._beat = link, None, None
        return link

    def _lost(self, e: Closed) -> None:
        """The stream ended (or did not open): the next one is tried after a jittered
        backoff, at the next coordinator if this one could not be reached; after a refusal,
        when the worker asks again."""
        if self._link is not None:
            with contextlib.suppress(Exception):
                self._run(self._link.close(), 10)
        self._link, self._offered = None, None
        if e.code in REFUSALS:  # the worker paces its own asks (a pending machine's, slower)
            self._next_try = 0.0
            return
        if e.code is grpc.StatusCode.UNAVAILABLE:
            self.unreachable()
        self._next_try = time.monotonic() + self._backoff.after(e)

    @staticmethod
    def _pause(until: float, give_up: Callable[[], bool] | None) -> None:
        """Wait (on this thread) until `until`, or until `give_up` says so."""
        while (left := until - time.monotonic()) > 0:
            if give_up is not None and give_up():
                return
            time.sleep(min(GIVE_UP_S, left))

    def _started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, daemon=True, name="link")
            self._thread.start()
            self._loop = loop
        return self._loop

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """The coroutine's result, run on the link's loop; a stream that does not answer in
        `timeout` counts as one the coordinator could not be reached on (Closed)."""
        running = asyncio.run_coroutine_threadsafe(coroutine, self._started())
        try:
            return running.result(timeout)
        except concurrent.futures.TimeoutError as e:
            running.cancel()
            raise Closed(f"no answer in {timeout:.0f} s", grpc.StatusCode.UNAVAILABLE) from e
