"""The platform's package caches, for machines only: /v1/mirrors on the coordinator's REST.

A sweep over many machines fetches each wheel and each Debian package from the internet once:

- `/v1/mirrors/pypi/index/` is a PyPI simple index (proxpi, in this process), caching what
  it serves (CAMPUGRID_PIP_UPSTREAM, default PyPI) under the coordinator's state folder;
- `/v1/mirrors/apt/<host>/<path>` is the embedded apt-cacher-ng (cli/aptcache.py, listening
  on 127.0.0.1), for the distributions' own mirrors (APT_HOSTS) and nothing else.

Only approved machines get in: every request carries a token the coordinator minted for one
machine in its lease (HTTP Basic password, any user name, as pip and apt send them), an ES256
JWT with this audience, checked here for signature, expiry and kind, and that machine must
still be approved (as every gRPC call checks it: a revocation holds within a second, in every
coordinator process); only reading (GET, HEAD) under those two paths reaches either cache.
Requests count against their address's rate limit like any REST call, and a refused token
against its failures (coordinator/auth.py).
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from starlette.concurrency import run_in_threadpool

from campugrid.coordinator.auth import Guard
from campugrid.coordinator.machines import MachineRecord
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.registry import ISSUER, ensure_signing_key
from campugrid.egress.policy import APT_HOSTS
from campugrid.protocol.errors import AuthError, RateLimited

AUDIENCE = "campugrid-mirror"
KINDS = ("pypi", "apt", "egress")  # what a machine's token opens (egress: campugrid.egress)
PREFIX = "/v1/mirrors"
DEFAULT_UPSTREAM = "https://pypi.org/simple/"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class MirrorTokens:
    """Tokens for the mirrors, signed with the registry's key (registry/token.key)."""

    def __init__(self, folder: Path, ttl_s: float = 1800) -> None:
        key_path, cert_path = ensure_signing_key(folder)
        self.ttl_s = ttl_s
        self._key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        self._public = x509.load_pem_x509_certificate(cert_path.read_bytes()).public_key()

    def mint(self, machine_id: str) -> str:
        now = int(time.time())
        return jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": f"machine:{machine_id}",
                           "iat": now, "nbf": now - 5, "exp": now + int(self.ttl_s),
                           "jti": secrets.token_hex(8), "kinds": list(KINDS)},
                          self._key, algorithm="ES256")  # type: ignore[arg-type]

    def check(self, token: str, kind: str) -> str | None:
        """The machine a valid token for `kind` was minted for; None for any other token."""
        try:
            claims = jwt.decode(token, self._public, algorithms=["ES256"],  # type: ignore[arg-type]
                                audience=AUDIENCE, issuer=ISSUER,
                                options={"require": ["exp", "sub", "aud", "iss"]})
        except jwt.PyJWTError:
            return None
        sub = str(claims.get("sub", ""))
        return sub if kind in (claims.get("kinds") or []) and sub.startswith("machine:") else None


def machine_refusal(tokens: MirrorTokens, machine: Callable[[str], MachineRecord], guard: Guard,
                    token: str, kind: str, address: str) -> tuple[int, str] | None:
    """Why a request with this token may not use `kind` (HTTP status, reason); None: it may."""
    sub = tokens.check(token, kind)
    try:
        if sub is None:
            guard.failed(address, "", f"a {kind} request without a valid machine token",
                         why="mirror_token")
            return 401, "a machine's token is needed (from its lease)"
        record = machine(sub.removeprefix("machine:"))
    except RateLimited as e:
        return 429, str(e)
    except AuthError as e:
        return 403, str(e)
    if record.status is not MachineStatus.APPROVED:
        return 403, (f"machine {record.id} is {record.status.value}: the package caches and "
                     "the egress proxy serve approved machines only")
    return None


def egress_check(tokens: MirrorTokens, machine: Callable[[str], MachineRecord],
                 guard: Guard) -> Callable[[str, str], str | None]:
    """The platform egress proxy's check of a Proxy-Authorization header (campugrid.egress):
    an approved machine's token, as the caches take it; None, or why not."""
    def check(header: str, address: str) -> str | None:
        scheme, _, credentials = header.partition(" ")
        token = ""
        if scheme.lower() == "basic":
            try:
                token = base64.b64decode(credentials.strip()).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                token = ""
        refused = machine_refusal(tokens, machine, guard, token, "egress", address)
        return refused[1] if refused is not None else None
    return check


def create_mirrors(tokens: MirrorTokens, *, pypi_dir: Path | None, apt_address: str,
                   machine: Callable[[str], MachineRecord], guard: Guard) -> App:
    """The ASGI app mounted at PREFIX: each configured cache behind the token check and the
    machine's status (`machine`: the coordinator's cached read of it, as gRPC calls use)."""
    pypi = _pypi(pypi_dir) if pypi_dir is not None else None
    apt = _apt(apt_address) if apt_address else None

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        kind, _, rest = _relative(scope).lstrip("/").partition("/")
        target = {"pypi": pypi, "apt": apt}.get(kind)
        if target is None or {".", ".."} & set(rest.split("/")):
            return await _answer(send, 404, f"no mirror {kind!r} here, or a path that climbs")
        if scope["method"] not in ("GET", "HEAD"):
            return await _answer(send, 405, "the mirrors are read-only")
        address = (scope.get("client") or ("?", 0))[0]
        refused = await run_in_threadpool(machine_refusal, tokens, machine, guard, _token(scope),
                                          kind, address)
        if refused is not None:
            return await _answer(send, *refused, {"www-authenticate": 'Basic realm="campugrid"'}
                                 if refused[0] == 401 else None)
        if kind == "pypi" and not rest.startswith("index/"):
            return await _answer(send, 404, "only the index is served: /index/")
        root = scope["path"][:len(scope["path"]) - len(rest) - 1]  # .../v1/mirrors/<kind>
        await target(dict(scope, root_path=root), receive, send)

    return app


def _relative(scope: Scope) -> str:
    """The path below the app's mount point (Starlette keeps the whole path in `path`, the
    mount point in `root_path`)."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return path[len(root):] if root and path.startswith(root) else path


def _token(scope: Scope) -> str:
    for name, value in scope.get("headers") or []:
        if name.lower() != b"authorization":
            continue
        kind, _, credentials = value.decode("latin-1").partition(" ")
        if kind.lower() == "bearer":
            return str(credentials.strip())
        if kind.lower() == "basic":
            try:
                return str(base64.b64decode(credentials.strip()).decode().partition(":")[2])
            except (ValueError, UnicodeDecodeError):
                return ""
    return ""


async def _answer(send: Send, status: int, text: str,
                  headers: dict[str, str] | None = None) -> None:
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *[(k.encode(), v.encode()) for k, v in (headers or {}).items()]]})
    await send({"type": "http.response.body", "body": body})


def _pypi(folder: Path) -> App:
    """proxpi's Flask app, in this process, caching under `folder`. proxpi keeps one app and
    one cache per process, configured from its module's settings: they are set here and the
    cache made anew, so the last mirrors app made in a process is the one that serves."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ.setdefault("PROXPI_LOGGING_LEVEL", "WARNING")  # read once, at import
    from a2wsgi import WSGIMiddleware
    from proxpi import _cache, server  # type: ignore[import-untyped]

    _cache.INDEX_URL = os.environ.get("CAMPUGRID_PIP_UPSTREAM") or DEFAULT_UPSTREAM
    _cache.CACHE_DIR = str(folder)
    _cache.CACHE_SIZE = int(os.environ.get("CAMPUGRID_PIP_MIRROR_MB") or 8192) * 1024**2
    # Serve every file from the cache, however long its first download takes (proxpi would
    # otherwise send the client to the upstream after 0.9 s, past the cache)
    _cache.DOWNLOAD_TIMEOUT = 900.0
    server.cache = _cache.Cache.from_config()
    return WSGIMiddleware(server.app)  # type: ignore[return-value]


def _apt(address: str) -> App:
    """A streaming pass-through to apt-cacher-ng, for APT_HOSTS' paths only."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path = _relative(scope)
        host = path.lstrip("/").partition("/")[0]
        if host not in APT_HOSTS or not re.fullmatch(r"/[A-Za-z0-9._~+/-]+", path) \
                or "/../" in path + "/":
            return await _answer(send, 404, f"the apt cache serves only {', '.join(APT_HOSTS)}")
        headers = {k.decode(): v.decode("latin-1") for k, v in scope.get("headers") or []
                   if k.lower() in (b"if-modified-since", b"range", b"if-range",
                                    b"cache-control")}
        # A client per request, closed with it: nothing stays open past the answer
        async with httpx.AsyncClient(base_url=f"http://{address}",
                                     timeout=httpx.Timeout(60, read=900)) as client, \
                client.stream(scope["method"], path, headers=headers) as response:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode(), v.encode("latin-1"))
                                    for k, v in response.headers.items()
                                    if k.lower() in ("content-type", "content-length",
                                                     "last-modified", "content-range",
                                                     "accept-ranges", "etag")]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app
