"""Who may call the agents' gRPC service: every call signed by a machine's own key
(SignedCalls: a unary call over its request's bytes, a stream once as it opens), the checked
machine handed to the handler (CALLER), and every line logged about a job naming it
(AboutJob). Both are grpc.aio interceptors, for plain handlers (run on the server's pool)
and coroutines alike."""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

import grpc

from campugrid.coordinator.apps import Nonces
from campugrid.coordinator.machines import MachineRecord, Status
from campugrid.coordinator.service import Coordinator
from campugrid.protocol import keys, logs
from campugrid.protocol.errors import CampugridError, Unauthenticated
from campugrid.protocol.wire import (
    CALL_WINDOW_S,
    CREATED_HEADER,
    KEY_HEADER,
    MACHINE_HEADER,
    NONCE_HEADER,
    RETRY_AFTER_HEADER,
    SIGNATURE_HEADER,
    STREAM_BODY,
    call_base,
)

log = logging.getLogger("campugrid.coordinator.agents")
REGISTER = "/campugrid.v1.AgentService/Register"
# Streams joining at once (being checked, or taken but their machine has not said it is
# ready yet, for up to fleet.JOIN_S); one more waits in line, first come first taken, up to
# what is being taken in Admission.LINE_S; past that it is refused at once
# (RESOURCE_EXHAUSTED) and told when to try again (Admission). Thousands of agents
# reconnecting after a restart would otherwise queue their joins on the server's loop longer
# than an agent waits for its stream (link.OPEN_S): the work would all be for agents that had
# given up, and none would get in (bench/fleet.py).
MAX_OPENING = 64
# The machine whose signature SignedCalls checked, for the handler of this call.
CALLER: contextvars.ContextVar[MachineRecord | None] = contextvars.ContextVar(
    "campugrid_machine", default=None)


def peer_address(context: grpc.ServicerContext) -> str:
    """`ipv4:1.2.3.4:5678` -> `1.2.3.4` (and likewise for ipv6)."""
    peer = str(context.peer() or "")
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]").replace("%5B", "").replace("%5D", "") or rest
    return peer[:100]



class Abort(Exception):
    """What context.abort would have done, raised on a thread (see Aborts)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Aborts:
    """A coroutine handler's context, for code that runs on a thread and aborts the way a
    plain handler does (`context.abort(code, details)`): the abort is raised as Abort, and
    the coroutine aborts the call with it."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Abort(code, details)

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return str(self._context.peer())


def _unary(behaviour: Callable[..., Any], handler: Any, **kw: Any) -> Any:
    return grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=kw.get("request_deserializer",
                                               handler.request_deserializer),
        response_serializer=handler.response_serializer)


class Admission:
    """When a stream turned away (MAX_OPENING, and the line full) should come back: each one
    is given the next free moment at AHEAD times the rate this process can take streams, so
    that thousands coming back at once after a restart are let in as fast as it can take
    them, none waiting for a backoff that grew while others got in. Those that come back
    before there is room wait in line (SignedCalls), up to what is taken in LINE_S: a moment
    too early costs a wait, one too late costs idle CPU. (Moments given at the rate alone were
    mostly given while thousands were being turned away at once, when the rate says least:
    at 10,000 agents, half the CPU stood idle while they came back at 254 a second.)

    That rate is what CORES of its CPU take at what a stream taken has cost it lately: all
    the process's CPU time over the last WINDOW_S (TLS, the checks, the refusals, whatever
    else it did: the estimate errs slow) over the streams taken meanwhile. Never below the
    rate streams are being taken, nor FLOOR_PER_S. (Spaced at the rate taken alone, as it
    was, the first moments were given at the floor, the streams came back at that rate, and
    so it stayed: 10,000 agents back after a restart 100 s later, with a third of the CPU
    idle meanwhile; bench/fleet.py.)"""

    WINDOW_S = 2.0
    # What one core takes at the least: a join costs a process about 4.5 ms of CPU
    # (bench/fleet.py), so about 200 a second. While thousands are being turned away at once
    # (a restart), their TLS handshakes and refusals cost it more than the joins: what a
    # stream taken then costs says too little, and the moments given out then are most of them.
    FLOOR_PER_S = 200.0
    MOST_S = 120.0
    CORES = 1.0  # what the joins may take: one core, as much as the server's one loop can use
    SAMPLE = 16  # streams taken within the window before what they cost is trusted
    AHEAD = 2.0
    # The longest wait in line: its length, at the rate streams are being taken. Well
    # under what an agent waits for its stream to be taken (link.OPEN_S, 20 s).
    LINE_S = 8.0

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self._clock, self._cpu = clock, cpu
        self._taken: deque[tuple[float, float]] = deque()  # recent streams: when, CPU then
        self._next = 0.0  # the last moment given out

    def taken(self) -> None:
        now = self._clock()
        self._taken.append((now, self._cpu()))
        self._forget(now)

    def rate(self) -> float:
        """Streams a second this process can take now."""
        self._forget(self._clock())
        taken = len(self._taken)
        rate = taken / self.WINDOW_S
        if taken >= self.SAMPLE and (spent := self._cpu() - self._taken[0][1]) > 0:
            rate = max(rate, self.CORES * taken / spent)
        return max(self.FLOOR_PER_S, rate)

    def line(self) -> int:
        """How many streams may wait in line: what is being taken in LINE_S, and at least
        what FLOOR_PER_S takes in it. (Without the floor, a process that had just started had
        a line of none: all but its first MAX_OPENING streams were turned away, given
        moments at the floor's rate, and came back over 25 s; 10,000 agents back after a
        restart in 39-50 s, 32 s with it, bench/fleet.py.)"""
        self._forget(self._clock())
        return int(max(self.FLOOR_PER_S, len(self._taken) / self.WINDOW_S) * self.LINE_S)

    def retry_after(self) -> float:
        """Seconds until this refused stream's moment."""
        rate = self.AHEAD * self.rate()
        now = self._clock()
        self._next = min(max(self._next, now) + 1 / rate, now + self.MOST_S)
        return self._next - now

    def _forget(self, now: float) -> None:
        while self._taken and self._taken[0][0] < now - self.WINDOW_S:
            self._taken.popleft()


class SignedCalls(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Every call must be signed by a machine's own key, over the method, the SHA-256 of the
    request's bytes as they came (wrapped around the deserializer, so nothing is
    re-serialized), the time and a nonce (campugrid.protocol.wire). A revoked machine is
    refused here, whatever it calls; the handlers see the checked machine in CALLER. The
    check runs where the call does: a plain handler's thread, or for a coroutine, a thread of
    `blocking` (it reads the machine and writes the nonce)."""

    def __init__(self, coord: Coordinator, nonces: Nonces, blocking: Executor) -> None:
        self.coord = coord
        self.nonces = nonces
        self.metrics = coord.metrics
        self.blocking = blocking
        self.opening = 0  # streams being checked now (on the server's loop: no lock)
        # Streams taken whose machine has not said it is ready yet (the fleet's count; it
        # calls `room` as one says so or ends).
        self.joining: Callable[[], int] = lambda: 0
        self.admission = Admission()
        self._line: deque[asyncio.Future[None]] = deque()  # streams waiting for room, in turn
        self._in_line: set[str] = set()  # the machines of those streams
        self.waiting = 0  # of those, not given up

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is not None and handler.stream_stream is not None:
            return self._stream(handler, details.method)
        if handler is None or handler.unary_unary is None:
            return None  # nothing else is served unsigned: the caller is told UNIMPLEMENTED
        inner, deserialize, method = handler.unary_unary, handler.request_deserializer, details.method

        def digested(raw: bytes) -> tuple[str, Any]:
            return hashlib.sha256(raw).hexdigest(), deserialize(raw)

        if inspect.iscoroutinefunction(inner):
            async def checked_first(call: tuple[str, Any], context: Any) -> Any:
                digest, request = call
                try:
                    record = await asyncio.get_running_loop().run_in_executor(
                        self.blocking, self._check, method, digest, Aborts(context))
                except Abort as a:
                    await context.abort(a.code, a.details)
                token = CALLER.set(record)
                try:
                    return await inner(request, context)
                finally:
                    CALLER.reset(token)

            return _unary(checked_first, handler, request_deserializer=digested)

        def behaviour(call: tuple[str, Any], context: grpc.ServicerContext) -> Any:
            digest, request = call
            record = self._check(method, digest, context)
            token = CALLER.set(record)
            try:
                return inner(request, context)
            finally:
                CALLER.reset(token)

        return _unary(behaviour, handler, request_deserializer=digested)

    def _stream(self, handler: Any, method: str) -> Any:
        """A stream, checked when it opens (wire.STREAM_BODY); its messages are the signer's."""
        inner = handler.stream_stream
        digest = hashlib.sha256(STREAM_BODY).hexdigest()

        async def checked_first(requests: Any, context: Any) -> AsyncIterator[Any]:
            if not await self._enter(lambda: self._known_signer(method, digest, context)):
                self.metrics.refused("grpc", "busy")
                later = self.admission.retry_after()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "the coordinator is taking many streams at once: try again "
                                    f"in {later:.1f} s",
                                    trailing_metadata=((RETRY_AFTER_HEADER, str(int(later * 1000))),))
            try:
                record = await asyncio.get_running_loop().run_in_executor(
                    self.blocking, self._check, method, digest, Aborts(context))
            except Abort as a:
                await context.abort(a.code, a.details)
            finally:
                self.opening -= 1
                self.room()
            self.admission.taken()
            CALLER.set(record)  # this call's own context: it ends with the call
            async for reply in inner(requests, context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(
            checked_first, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    async def _enter(self, signer: Callable[[], str | None]) -> bool:
        """Room for one more stream to join: now, or after a wait in line (first come, first
        taken); False when the line is full, or the stream's `signer` is not a machine this
        process knows, or is one with a stream in line already (it is turned away, told when
        to come back)."""
        if not self.waiting and self.opening + self.joining() < MAX_OPENING:
            self.opening += 1
            return True
        if self.waiting >= max(MAX_OPENING, self.admission.line()):
            return False
        machine = signer()
        if machine is None or machine in self._in_line:
            return False
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        self._in_line.add(machine)
        self.waiting += 1
        try:
            await turn  # `room` counted it as opening
        except asyncio.CancelledError:  # the agent gave up, or the call ended
            if turn.done() and not turn.cancelled():  # its turn came as it went
                self.opening -= 1
                self.room()
            else:
                self.waiting -= 1
                turn.cancel()
            raise
        finally:
            self._in_line.discard(machine)
        return True

    def room(self) -> None:
        """A stream was checked, or a machine joined or left: the first in line take the
        room there is (on the server's loop)."""
        while self._line and self.opening + self.joining() < MAX_OPENING:
            turn = self._line.popleft()
            if turn.done():
                continue  # given up
            self.waiting -= 1
            self.opening += 1
            turn.set_result(None)

    def _known_signer(self, method: str, digest: str, context: Any) -> str | None:
        """The machine that signed a stream that would wait in line, within the call window,
        if this process holds its record (on the loop: no read, no nonce; its whole check
        comes with its turn); None if none. A place in line is held for seconds, not the
        moment a check takes: without this, anyone who can open a TLS connection could fill
        the line with unsigned streams for a few hundred a second and keep the machines out;
        and a machine holds one place at most (`_enter`), so that one machine's key cannot."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        record = self.coord.machines.known(md.get(MACHINE_HEADER, ""))
        if record is None or record.status is Status.REVOKED or _unsigned(
                md, method, digest, record.id, keys.parse_public(record.public_key)) is not None:
            return None
        return record.id

    def _check(self, method: str, digest: str, context: grpc.ServicerContext) -> MachineRecord | None:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}

        def refuse(code: grpc.StatusCode, reason: str, who: str = "",
                   why: str = "bad_signature") -> None:
            log.warning("refused call %s: %s (machine %s, from %s)", method.rpartition("/")[2],
                        reason, who or "-", peer_address(context))
            self.metrics.refused("grpc", why)
            context.abort(code, reason)

        record: MachineRecord | None = None
        if method == REGISTER:
            key_text = md.get(KEY_HEADER, "")
            signer = f"key:{key_text}"
            try:
                public = keys.parse_public(key_text)
            except CampugridError as e:
                refuse(grpc.StatusCode.UNAUTHENTICATED, f"Register: {e} ({KEY_HEADER})",
                       why="bad_key")
        else:
            machine_id = md.get(MACHINE_HEADER, "")
            signer = machine_id
            try:
                record = self.coord.machines.get(machine_id)
            except Unauthenticated as e:
                refuse(grpc.StatusCode.UNAUTHENTICATED, str(e), machine_id[:40], "unknown_key")
            assert record is not None
            if record.status is Status.REVOKED:
                refuse(grpc.StatusCode.PERMISSION_DENIED,
                       f"machine {record.id} was revoked by its owner: it gets no work, URLs "
                       "or data; join again with a new key if this is a mistake", record.id,
                       "revoked")
            public = keys.parse_public(record.public_key)
        unsigned = _unsigned(md, method, digest, signer, public)
        if unsigned is not None:
            refuse(grpc.StatusCode.UNAUTHENTICATED, unsigned[0], signer[:40], unsigned[1])
        nonce = md.get(NONCE_HEADER, "")
        try:
            self.nonces.use(signer, nonce, CALL_WINDOW_S)
        except Unauthenticated as e:
            refuse(grpc.StatusCode.UNAUTHENTICATED, str(e), signer[:40], "replayed")
        return record


def _unsigned(md: dict[str, str], method: str, digest: str, signer: str,
              public: keys.Ed25519PublicKey) -> tuple[str, str] | None:
    """Why this call's signature by `signer` (its time, nonce and signature headers) does not
    hold, and the metric's word for it; None if it holds. The nonce is not spent here."""
    created_text, nonce = md.get(CREATED_HEADER, ""), md.get(NONCE_HEADER, "")
    if not created_text.isdigit() or not nonce:
        return (f"this call is not signed ({CREATED_HEADER}, {NONCE_HEADER} and "
                f"{SIGNATURE_HEADER} are needed; see campugrid.protocol.wire)", "unsigned")
    if abs(time.time() - int(created_text)) > CALL_WINDOW_S:
        return (f"this call was signed at {created_text}, more than {CALL_WINDOW_S} s from "
                "the coordinator's clock: check the machine's clock", "expired")
    try:
        signature = base64.b64decode(md.get(SIGNATURE_HEADER, ""), validate=True)
        public.verify(signature, call_base(method, digest, int(created_text), nonce, signer))
    except (ValueError, keys.InvalidSignature):
        return ("the call's signature does not verify with this machine's key (another key, "
                "or the call was changed after signing)", "bad_signature")
    return None


class AboutJob(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Every line logged while serving a call about a job names the job and the attempt
    (campugrid.protocol.logs), without each handler saying so."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        if inspect.iscoroutinefunction(inner):
            async def about_async(request: Any, context: Any) -> Any:
                job_id = getattr(request, "job_id", "")
                if not job_id:
                    return await inner(request, context)
                with logs.about_job(job_id, getattr(request, "fencing_token", None) or None):
                    return await inner(request, context)

            return _unary(about_async, handler)

        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            job_id = getattr(request, "job_id", "")
            if not job_id:
                return inner(request, context)
            with logs.about_job(job_id, getattr(request, "fencing_token", None) or None):
                return inner(request, context)

        return _unary(behaviour, handler)
