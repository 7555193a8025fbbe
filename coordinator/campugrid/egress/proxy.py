"""The egress proxy: CONNECT tunnels and plain-HTTP requests in absolute form, nothing else.

    request head -> authorized? (the platform's: a machine's token) -> the policy's host check
      -> a route (plain HTTP for a cached host: the platform's cache, with its token)
         or the parent (the platform's proxy, asked with CONNECT and this machine's token)
         or direct (resolved here, public addresses only)
      -> bytes both ways, counted against the budget -> one Record, for the build log

A build reaches this only through its relay (builders/relay.py); it sees no token. Requests
are forwarded with `Connection: close`, one per connection, so each is one record."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

from campugrid.egress.policy import Policy, Refused, split_host_port

MAX_HEAD = 64 * 1024
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 20.0
REFUSED_HEADER = "X-Campugrid-Refused"
HOP = {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "te",
       "trailer", "upgrade", "proxy-authenticate"}


@dataclasses.dataclass(frozen=True)
class Upstream:
    """Somewhere this proxy connects itself: the platform's proxy, or one of its caches."""

    url: str  # http(s)://host:port[/path]: a cache's path replaces the request's host
    token: str = ""  # sent as HTTP Basic (any user name), as the platform's caches take it
    certificate: str = ""  # PEM to trust for https: the coordinator's own certificate

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"campugrid:{self.token}".encode()).decode()

    def split(self) -> tuple[str, int, str, bool]:
        parts = urllib.parse.urlsplit(self.url)
        tls = parts.scheme == "https"
        return (parts.hostname or "", parts.port or (443 if tls else 80),
                parts.path.rstrip("/"), tls)


@dataclasses.dataclass
class Record:
    """One connection, as the build log shows it."""

    method: str
    host: str
    port: int
    path: str = ""
    refused: str = ""  # why, if it was
    via: str = ""  # "the platform's apt cache", "the platform's egress proxy"
    received: int = 0  # bytes to the build
    sent: int = 0  # bytes from the build
    seconds: float = 0.0

    def line(self) -> str:
        where = f"{self.host}{self.path}" if self.path else f"{self.host}:{self.port}"
        if self.method == "?":  # it never said what it wanted
            return f"[egress] refused a connection: {self.refused}"
        if self.refused:
            return f"[egress] refused {self.method} {where}: {self.refused}"
        via = f" via {self.via}" if self.via else ""
        return (f"[egress] {self.method} {where}{via}: {self.received:,} bytes in, "
                f"{self.sent:,} out, {self.seconds:.1f} s")


class EgressProxy:
    """`policy` decides hosts (and addresses, when connecting directly); `parent`: ask the
    platform's proxy instead of connecting; `routes`: plain-HTTP hosts served by a cache;
    `authorize`: the platform's check of a Proxy-Authorization header and the peer's address
    (None: allowed, else why not); `budget`: bytes a build may receive in all; `log`: hears
    every Record."""

    def __init__(self, policy: Policy, *, parent: Upstream | None = None,
                 routes: Mapping[str, tuple[Upstream, str]] | None = None,
                 authorize: Callable[[str, str], str | None] | None = None,
                 budget: int | None = None, log: Callable[[Record], None] | None = None) -> None:
        self.policy, self.parent, self.routes = policy, parent, dict(routes or {})
        self.authorize, self.budget, self.log = authorize, budget, log
        self.received = 0
        self.over = ""  # why everything is refused from now on (the budget is spent)
        self._writers: set[asyncio.StreamWriter] = set()

    def close_all(self) -> None:
        """Close every connection, to the build and upstream."""
        for writer in list(self._writers):
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        rec = Record("?", "?", 0)
        began = time.monotonic()
        try:
            await self._handle(reader, writer, rec)
        except Refused as e:
            rec.refused = str(e)
            with contextlib.suppress(OSError, RuntimeError):
                await _answer(writer, e.status, rec.refused)
        except asyncio.LimitOverrunError:
            rec.refused = f"a request head over {MAX_HEAD // 1024} KiB"
            with contextlib.suppress(OSError, RuntimeError):
                await _answer(writer, 400, rec.refused)
        except asyncio.IncompleteReadError:
            rec.refused = rec.refused or "closed before a whole request"
        except (TimeoutError, OSError, ValueError) as e:
            rec.refused = rec.refused or f"{type(e).__name__}: {e}"[:300]
            with contextlib.suppress(OSError, RuntimeError):
                await _answer(writer, 502, rec.refused)
        finally:
            rec.seconds = time.monotonic() - began
            self._writers.discard(writer)
            writer.close()
            if self.log is not None:  # every connection, whatever it sent
                self.log(rec)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      rec: Record) -> None:
        # The servers' stream limit is MAX_HEAD: a longer head is a LimitOverrunError here.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        lines = head.decode("latin-1").split("\r\n")
        words = lines[0].split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            raise Refused("not an HTTP/1 proxy request", 400)
        method, target = words[0], words[1]
        headers = [(k.strip(), v.strip()) for k, _, v in
                   (h.partition(":") for h in lines[1:] if h)]
        rec.method = method
        if method == "CONNECT":
            host, port = split_host_port(target)
            path = ""
        elif target.lower().startswith("http://"):
            url = urllib.parse.urlsplit(target)
            host, port = (url.hostname or ""), url.port or 80
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        else:
            rec.host = target[:200]
            raise Refused("not a proxy request: CONNECT host:port, or a plain http:// URL "
                          "(https goes through CONNECT)")
        rec.host, rec.port, rec.path = host, port, path
        if self.authorize is not None:
            said = next((v for k, v in headers if k.lower() == "proxy-authorization"), "")
            peer = writer.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            why = await asyncio.to_thread(self.authorize, said, address)
            if why:
                raise Refused(why, 407)
        if self.over:
            raise Refused(self.over)
        rest = [(k, v) for k, v in headers if k.lower() not in HOP]
        route = self.routes.get(host.lower()) if method != "CONNECT" and port == 80 else None
        if route is not None:
            upstream, rec.via = route
            r, w = await self._open(upstream)
            uhost, uport, prefix, _ = upstream.split()
            rest = [(k, v) for k, v in rest if k.lower() not in ("host", "authorization")]
            request = _head(f"{method} {prefix}{path}",
                            [("Host", f"{uhost}:{uport}"), ("Authorization", upstream.basic()),
                             *rest])
        else:
            name = self.policy.target(host, port)
            if self.parent is not None:
                rec.via = "the platform's egress proxy"
                r, w = await self._open(self.parent)
                w.write(_head(f"CONNECT {name}:{port}",
                              [("Host", f"{name}:{port}"),
                               ("Proxy-Authorization", self.parent.basic())]))
                answer = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT_S)
                status, said = _status(answer)
                if status != 200:
                    w.close()
                    raise Refused(f"the platform's egress proxy: {said}")
            else:
                r, w = await self._direct(name, port)
            request = _head(f"{method} {path}", [*rest]) if method != "CONNECT" else b""
        self._writers.add(w)
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                w.write(request)
            await self._pipe(reader, writer, r, w, rec)
        finally:
            self._writers.discard(w)
            w.close()

    async def _open(self, up: Upstream) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port, _, tls = up.split()
        context = None
        if tls:
            context = ssl.create_default_context(cadata=up.certificate or None)
            if up.certificate:  # our own certificate, pinned: its name need not match
                context.check_hostname = False
        return await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context),
                                      CONNECT_TIMEOUT_S)

    async def _direct(self, host: str, port: int
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # Resolved once, here, and the checked address is what is connected to.
        addresses = await asyncio.to_thread(self.policy.addresses, host, port)
        error: OSError | None = None
        for address, to in addresses:
            try:
                return await asyncio.wait_for(asyncio.open_connection(address, to),
                                              CONNECT_TIMEOUT_S)
            except (TimeoutError, OSError) as e:
                error = e if isinstance(e, OSError) else OSError(f"{address}: timed out")
        raise error or OSError(f"{host}: no address")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    r: asyncio.StreamReader, w: asyncio.StreamWriter, rec: Record) -> None:
        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            while data := await src.read(256 * 1024):
                if down:
                    rec.received += len(data)
                    self.received += len(data)
                    if self.budget is not None and self.received > self.budget:
                        self.over = (f"the build downloaded more than "
                                     f"{self.budget // 1024**2} MB (resources.disk_mb)")
                        rec.refused = self.over
                        self.close_all()
                        return
                else:
                    rec.sent += len(data)
                dst.write(data)
                await dst.drain()
            with contextlib.suppress(OSError, RuntimeError):
                if dst.can_write_eof():
                    dst.write_eof()
        await asyncio.gather(copy(reader, w, False), copy(r, writer, True),
                             return_exceptions=True)


def _head(first: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"{first} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _status(head: bytes) -> tuple[int, str]:
    lines = head.decode("latin-1").split("\r\n")
    words = lines[0].split(" ", 2)
    try:
        status = int(words[1])
    except (IndexError, ValueError):
        return 0, "an answer that is not HTTP"
    said = next((v.strip() for k, _, v in (h.partition(":") for h in lines[1:])
                 if k.strip().lower() == REFUSED_HEADER.lower()), "")
    return status, said or " ".join(words[1:])


async def _answer(writer: asyncio.StreamWriter, status: int, why: str) -> None:
    text = {400: "Bad Request", 403: "Forbidden", 407: "Proxy Authentication Required",
            502: "Bad Gateway"}
    body = (why + "\n").encode()
    why_line = why.replace("\r", " ").replace("\n", " ")[:500]
    head = (f"HTTP/1.1 {status} {text.get(status, 'Error')}\r\n"
            f"{REFUSED_HEADER}: {why_line}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + ('Proxy-Authenticate: Basic realm="campugrid"\r\n' if status == 407 else "")
            + "\r\n")
    writer.write(head.encode("latin-1") + body)
    await writer.drain()


class Serving:
    """An EgressProxy on a unix socket or a TCP address, in a thread of its own, until
    close(): what an agent runs for one build, and the platform for all of them."""

    def __init__(self, proxy: EgressProxy, *, unix: Path | None = None,
                 tcp: tuple[str, int] | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address: tuple[str, int] | None = None
        self._thread = threading.Thread(target=self._run, args=(unix, tcp, tls),
                                        name="egress", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self, unix: Path | None, tcp: tuple[str, int] | None,
             tls: ssl.SSLContext | None) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            if unix is not None:
                server = self.loop.run_until_complete(
                    asyncio.start_unix_server(self.proxy.handle, path=str(unix), limit=MAX_HEAD))
            else:
                assert tcp is not None
                server = self.loop.run_until_complete(
                    asyncio.start_server(self.proxy.handle, tcp[0], tcp[1], ssl=tls,
                                         limit=MAX_HEAD))
                self.address = server.sockets[0].getsockname()[:2]
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            self.proxy.close_all()
            pending = asyncio.all_tasks(self.loop)
            for t in pending:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Serving:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
