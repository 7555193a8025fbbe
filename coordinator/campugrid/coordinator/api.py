"""The REST API as one application: its middleware (who signed, which job a request is
about), one error answer, the routers per noun (rest/), the console and the package caches."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette import formparsers
from starlette.types import ASGIApp, Receive, Scope, Send

from campugrid.console.app import create_console
from campugrid.coordinator.answers import answer, http_headers
from campugrid.coordinator.auth import Guard, RateLimits, SignedRequests
from campugrid.coordinator.mirrors import PREFIX as MIRRORS_PREFIX
from campugrid.coordinator.mirrors import MirrorTokens, create_mirrors
from campugrid.coordinator.rest import jobs, machines, metrics, people
from campugrid.coordinator.rest.deps import Site
from campugrid.coordinator.service import Coordinator
from campugrid.protocol import logs
from campugrid.protocol.errors import CampugridError


def _strict_decode(src: bytes | bytearray, codec: str) -> str:
    """Multipart form text must be what it says it is. Starlette falls back to Latin-1 where
    a field (or a field or file name) does not decode, which stores mojibake instead of
    refusing: refuse it, with where the first bad byte is."""
    try:
        return bytes(src).decode(codec or "utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(422, detail=f"a form field is not valid {e.encoding} text (byte "
                                        f"{bytes(src)[e.start]:#04x} at offset {e.start}); "
                                        "send it as UTF-8") from e
    except LookupError as e:
        raise HTTPException(422, detail=f"unknown charset {codec!r} in the form") from e


# Starlette has no option for this; the one place it decodes multipart text is this function.
formparsers._user_safe_decode = _strict_decode


_JOB_PATH = re.compile(r"^/v1/jobs/(?P<id>[^/]+)")


class AboutJob:
    """Every line logged while serving a request about one job names it (protocol.logs)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = _JOB_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if m is None:
            await self.app(scope, receive, send)
            return
        with logs.about_job(m["id"][:64], None):
            await self.app(scope, receive, send)


def create_app(coord: Coordinator, *, allow_unsigned: bool = False,
               limits: RateLimits | None = None, pin: str = "", grpc_address: str = "",
               public_url: str = "") -> FastAPI:
    """The REST API. `pin` is the coordinator certificate's fingerprint; `grpc_address` and
    `public_url` are how agents and apps reach it (for the join and login commands)."""
    app = FastAPI(title="campugrid", version="1", summary="Sandboxed GPU jobs on idle machines")
    app.add_middleware(AboutJob)
    guard = Guard(coord.limiter, limits)
    guard.on_refusal = lambda why: coord.metrics.refused("rest", why)
    app.state.site = Site(coord, guard, pin, grpc_address, public_url)
    app.add_middleware(SignedRequests, apps=coord.apps.keys, nonces=coord.apps.nonces,
                       guard=guard, allow_unsigned=allow_unsigned)

    @app.exception_handler(CampugridError)
    def _domain_error(_req: Request, exc: CampugridError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=answer(exc).http,
                            headers=http_headers(exc))

    @app.get("/", include_in_schema=False)
    def root(request: Request) -> Response:
        """A browser at the coordinator's address: to the console (the API is under /v1)."""
        return RedirectResponse(f"{request.scope.get('root_path', '')}/console/", 307)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)  # no icon, and no signature asked of a browser

    @app.get("/v1/health")
    def health() -> dict[str, str | int]:
        """Up; and the largest build context it takes (compressed), for clients to stop
        packing before they upload what would be refused."""
        return {"status": "ok", "max_context_bytes": coord.settings.max_context_bytes}

    for noun in (jobs, machines, people, metrics):
        app.include_router(noun.router)
    app.mount("/console", create_console(coord))
    settings = coord.settings
    if settings.pip_mirror_dir or settings.apt_cache:
        app.mount(MIRRORS_PREFIX, create_mirrors(
            MirrorTokens(settings.registry_dir),
            pypi_dir=Path(settings.pip_mirror_dir) if settings.pip_mirror_dir else None,
            apt_address=settings.apt_cache, machine=coord.machines.get, guard=guard))
    return app

