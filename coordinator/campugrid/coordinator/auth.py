"""Who is calling the REST API: RFC 9421 HTTP Message Signatures with the app's Ed25519 key,
and per-key and per-address rate limits.

Every request (but the health check, the invite redemption, the API's own docs, /metrics
(a scrape token of its own), the package caches under /v1/mirrors/ (a machine's token of
their own) and the web console, which has its own sign-in) must be signed
over `@method`, `@target-uri` and `content-digest` (RFC 9530), with `created`, `nonce` and
the app's id as `keyid`. The body is read (spooled to disk past 1 MiB) and checked against
its signed digest before the application sees a byte of it. The library
`http-message-signatures` builds the signature base and parses the fields; this module adds
the policy: which components, which window, the nonce store, and a reason for every refusal.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import logging
import tempfile
from collections.abc import Callable
from typing import Any

import http_message_signatures as hms
import http_sf
from http_message_signatures import algorithms
from http_message_signatures.structures import CaseInsensitiveDict
from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from campugrid.coordinator.apps import Apps, AppView, Nonces
from campugrid.coordinator.ratelimits import Limiter
from campugrid.protocol import keys
from campugrid.protocol.errors import RateLimited, Unauthenticated
from campugrid.protocol.identities import HttpMessage

log = logging.getLogger("campugrid.coordinator.auth")
REQUIRED = ("@method", "@target-uri", "content-digest")
WINDOW_S = 300  # a signature is good this long after its `created` time (skew included)
SKEW_S = 60  # and from this long before it: clocks differ
SPOOL_BYTES = 1024**2
CHUNK = 1024**2
# The only paths served without a signature: everything else, whatever its spelling, must
# be signed (a route added later is covered without a word here).
# /metrics checks a scrape token of its own (Prometheus cannot sign; coordinator.metrics).
# "/" leads a browser to the console, and a browser's /favicon.ico is answered plainly.
PUBLIC = frozenset({"/v1/health", "/v1/login", "/metrics", "/docs", "/docs/oauth2-redirect",
                    "/openapi.json", "/redoc", "/", "/favicon.ico"})
# The web console signs people in with its own sessions (console.gate), on every path under it.
CONSOLE = "/console"


def in_console(path: str) -> bool:
    return path == CONSOLE or path.startswith(CONSOLE + "/")


# The package caches check a machine's mirror token of their own (pip and apt cannot sign;
# coordinator.mirrors).
MIRRORS = "/v1/mirrors/"


# What an opted-in unsigned local caller acts as (CAMPUGRID_ALLOW_UNSIGNED, loopback only).
LOCAL_UNSIGNED = AppView("unsigned-local", "unsigned-local", "", True,
                         dt.datetime(2026, 1, 1, tzinfo=dt.UTC), None)


@dataclasses.dataclass(frozen=True)
class RateLimits:
    per_key_per_s: int = 50
    per_address_per_s: int = 100
    failures_per_address_per_min: int = 120  # refused signatures and invites


class _Verifier(hms.HTTPMessageVerifier):
    max_clock_skew = dt.timedelta(seconds=SKEW_S)


class _Keys(hms.HTTPSignatureKeyResolver):
    """Resolves a keyid to the app's public key, and remembers why it could not."""

    def __init__(self, apps: Apps) -> None:
        self.apps = apps
        self.app: AppView | None = None
        self.problem = ""

    def resolve_public_key(self, key_id: str) -> Any:
        app = self.apps.get(key_id) if len(key_id) <= 64 else None
        if app is None:
            self.problem = (f"unknown key id {key_id[:64]!r}: this app is not registered here "
                            "(log in with an invite: `campugrid login SERVER --invite CODE`)")
            return None
        self.app = app
        if app.revoked_at is not None:
            self.problem = (f"the key of app {app.name!r} was revoked on "
                            f"{app.revoked_at:%Y-%m-%d %H:%M} UTC; ask an admin for a new invite")
            return None
        return keys.parse_public(app.public_key)


class Guard:
    """Rate limits (sliding windows, counted in the database: the same for every coordinator
    process) and the record of refusals."""

    def __init__(self, limiter: Limiter, limits: RateLimits | None = None) -> None:
        self.limits = limits or RateLimits()
        self._limiter = limiter

    def limit(self, kind: str, who: str, item: RateLimitItem) -> None:
        if not self._limiter.hit(item, kind, who):
            wait = self._limiter.retry_after(item, kind, who)
            raise RateLimited(f"too many requests from this {kind}; retry in {wait} s", wait)

    # Told the kind of every refusal (`why`: unsigned, bad_signature, replayed, …) for /metrics.
    on_refusal: Callable[[str], None] | None = None

    def failed(self, address: str, key_id: str, reason: str,
               why: str = "bad_signature") -> Unauthenticated:
        """Log a refusal (with the key id and the address) and count it against the address."""
        if self.on_refusal is not None:
            self.on_refusal(why)
        log.warning("refused request: %s (key id %s, from %s)", reason, key_id or "-", address)
        self.limit("failures", address,
                   RateLimitItemPerMinute(self.limits.failures_per_address_per_min))
        return Unauthenticated(reason)


class SignedRequests:
    """ASGI middleware: refuses unsigned or badly signed requests with 401 and a reason, and
    puts the calling app in `scope["state"]["caller"]`."""

    def __init__(self, app: ASGIApp, *, apps: Apps, nonces: Nonces, guard: Guard,
                 allow_unsigned: bool = False) -> None:
        self.app = app
        self.apps = apps
        self.nonces = nonces
        self.guard = guard
        self.allow_unsigned = allow_unsigned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("?", 0))[0]
        limits = self.guard.limits
        try:
            await run_in_threadpool(self.guard.limit, "address", address,
                                    RateLimitItemPerSecond(limits.per_address_per_s))
            if scope["path"] in PUBLIC or in_console(scope["path"]) or \
                    scope["path"].startswith(MIRRORS):
                await self.app(scope, receive, send)
                return
            body, replay = await _spool(receive)
            try:
                app = await run_in_threadpool(self._authenticate, scope, body, address)
                await run_in_threadpool(self.guard.limit, "key", app.id,
                                        RateLimitItemPerSecond(limits.per_key_per_s))
                scope.setdefault("state", {})["caller"] = app
                await self.app(scope, replay, send)
            finally:
                body.close()
        except Unauthenticated as e:
            await JSONResponse({"detail": str(e)}, status_code=401,
                               headers={"www-authenticate": 'Signature realm="campugrid"'})(
                scope, receive, send)
        except RateLimited as e:
            await JSONResponse({"detail": str(e)}, status_code=429,
                               headers={"retry-after": str(e.retry_after_s)})(scope, receive, send)

    def _authenticate(self, scope: Scope, body: _Spooled, address: str) -> AppView:
        headers = CaseInsensitiveDict(  # type: ignore[no-untyped-call]
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        if "signature" not in headers and "signature-input" not in headers:
            if self.allow_unsigned:
                return LOCAL_UNSIGNED
            raise self.guard.failed(address, "", (
                "the request is not signed: sign it with your app's key (RFC 9421; "
                "`campugrid.client` and the CLI do it for you; `campugrid login` makes a key)"),
                why="unsigned")
        message = HttpMessage(scope["method"], _target_uri(scope, headers), headers)
        found = _Keys(self.apps)
        verifier = _Verifier(signature_algorithm=algorithms.ED25519, key_resolver=found)
        try:
            [result] = verifier.verify(message, max_age=dt.timedelta(seconds=WINDOW_S - SKEW_S),
                                       require_components=REQUIRED)
        except (hms.InvalidSignature, hms.HTTPMessageSignaturesException, ValueError) as e:
            raise self.guard.failed(address, found.app.id if found.app else "",
                              found.problem or _why(str(e), found.app),
                              why=("revoked" if found.app and found.app.revoked_at
                                   else "unknown_key" if found.problem else "bad_signature")) from e
        app = found.app
        assert app is not None
        try:
            body.check(result.covered_components['"content-digest"'])
        except Unauthenticated as e:
            raise self.guard.failed(address, app.id, str(e), why="digest") from e
        if not isinstance(result.nonce, str):
            raise self.guard.failed(address, app.id,
                              "the signature has no nonce: sign every request with a new one")
        try:
            self.nonces.use(app.id, result.nonce, WINDOW_S)
        except Unauthenticated as e:
            raise self.guard.failed(address, app.id, str(e), why="replayed") from e
        return app


def _why(error: str, app: AppView | None) -> str:
    if "created" in error or "age" in error:
        return (f"the signature's time is not usable ({error}); a request is good for "
                f"{WINDOW_S} s around its `created` time: check this computer's clock")
    if "not covered" in error:
        return f"the signature must cover {', '.join(REQUIRED)} ({error})"
    if app is not None:
        return (f"the signature does not verify with the key of app {app.name!r}: signed with "
                "another key, or the method, path, query or a signed header was changed after "
                "signing")
    return f"the signature could not be read: {error}"


def _target_uri(scope: Scope, headers: Any) -> str:
    scheme = scope.get("scheme", "http")
    host = headers.get("host") or "{}:{}".format(*scope.get("server", ("localhost", 80)))
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{scheme}://{host}{path}" + (f"?{query}" if query else "")


class _Spooled:
    """The request body, spooled (memory, then disk past SPOOL_BYTES) and digested."""

    def __init__(self) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115
        self.digests = {"sha-256": hashlib.sha256(), "sha-512": hashlib.sha512()}
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.size += len(chunk)
        for h in self.digests.values():
            h.update(chunk)

    def check(self, field: str) -> None:
        """Every digest in the signed Content-Digest field must be this body's."""
        try:
            members = http_sf.parse(field.encode("ascii"), tltype="dictionary")
        except (ValueError, TypeError, UnicodeEncodeError) as e:
            raise Unauthenticated("the Content-Digest field is malformed (RFC 9530)") from e
        if not isinstance(members, dict) or not members:
            raise Unauthenticated("the Content-Digest field names no digest (RFC 9530)")
        for algorithm, member in members.items():
            value = member[0] if isinstance(member, tuple) else None
            h = self.digests.get(algorithm)
            if h is None or not isinstance(value, bytes):
                raise Unauthenticated(f"Content-Digest: use sha-256 or sha-512, not {algorithm!r}")
            if not hmac.compare_digest(value, h.digest()):
                raise Unauthenticated("the body does not match its signed Content-Digest: it "
                                      "was changed after signing")

    def close(self) -> None:
        self.file.close()


async def _spool(receive: Receive) -> tuple[_Spooled, Receive]:
    """Read the whole body first (digested as it comes), and a `receive` that replays it and
    then hands over to the real one (which waits for the client to go away)."""
    body = _Spooled()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Unauthenticated("the client went away before the body was complete")
        body.write(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body.file.seek(0)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        chunk = body.file.read(CHUNK)
        sent = body.file.tell() >= body.size
        return {"type": "http.request", "body": chunk, "more_body": not sent}

    return body, replay
