"""The web console under /console, put together: its routers per noun (`signin`, `jobs`,
`machines`), what every page shares (`pages`), the session gate (`gate`) and one error page.
Mounted by the REST app; everything it shows goes through the same coordinator services,
with the same ownership rules, as the API."""

from __future__ import annotations

from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from campugrid.console import jobs, machines, signin
from campugrid.console.gate import ConsoleGate
from campugrid.console.pages import Pages
from campugrid.coordinator.answers import answer
from campugrid.coordinator.auth import Guard
from campugrid.coordinator.service import Coordinator
from campugrid.protocol.errors import CampugridError

HERE = Path(__file__).parent
FORM_MARGIN_BYTES = 16 * 1024**2  # the submit form's fields and multipart framing


def create_console(coord: Coordinator) -> FastAPI:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    console = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    pages = Pages(coord, coord.users, Guard(coord.limiter), env)
    console.state.pages = pages
    console.add_middleware(ConsoleGate, users=coord.users,
                           max_body=coord.settings.max_context_bytes + FORM_MARGIN_BYTES)
    console.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @console.exception_handler(CampugridError)
    def _error(request: Request, exc: CampugridError) -> HTMLResponse:
        if not hasattr(request.state, "user"):
            request.state.user, request.state.session = None, ""
        return pages.page(request, "message.html", answer(exc).http, title="Not done",
                          message=str(exc))

    for router in (signin.public, signin.private, jobs.private, machines.private):
        console.include_router(router)
    return console
