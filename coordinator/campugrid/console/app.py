"""The console's pages: sign-in and enrolment, jobs (with live logs over server-sent events),
submit, machines. Mounted by the REST app at /console; everything it shows goes through the
same Coordinator calls, with the same ownership rules, as the API."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import jinja2
import segno
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from limits import RateLimitItemPerMinute
from starlette.concurrency import run_in_threadpool

from campugrid.console import charts, forms
from campugrid.console.gate import (
    FORM_COOKIE,
    SAFE,
    SESSION_COOKIE,
    ConsoleGate,
    check_csrf,
    csrf_token,
    form_secret,
    set_cookie,
    user_of,
)
from campugrid.coordinator.answers import answer
from campugrid.coordinator.auth import Guard
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.users import UserView
from campugrid.protocol.errors import (
    CampugridError,
    Forbidden,
    InvalidInput,
    RateLimited,
    Unauthenticated,
)
from campugrid.protocol.states import FINAL, JobState

HERE = Path(__file__).parent
STREAM_POLL_S = 0.5
CHART_MINUTES = 60
LOG_PAGE_CHARS = 512 * 1024  # per log on a job's page
FORM_MARGIN_BYTES = 16 * 1024**2  # the submit form's fields and multipart framing
SESSION_RECHECK_S = 10.0  # an open log stream ends this soon after its session does
KEEPALIVE_S = 15.0
STATES = [s.value for s in JobState]
SIGN_INS_PER_ADDRESS = RateLimitItemPerMinute(30)


def create_console(coord: Coordinator) -> FastAPI:
    users = coord.users
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    console = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    console.add_middleware(ConsoleGate, users=users,
                           max_body=coord.settings.max_context_bytes + FORM_MARGIN_BYTES)
    # Sign-in attempts per address, beside each account's lockout (counted in the database).
    guard = Guard(coord.limiter)
    console.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    async def csrf(request: Request) -> AsyncIterator[None]:
        await check_csrf(request, users)
        try:
            yield
        finally:
            if request.method not in SAFE:  # the uploaded files' spool files
                await (await request.form()).close()

    public = APIRouter(dependencies=[Depends(csrf)])
    private = APIRouter(dependencies=[Depends(csrf)])

    def page(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
        user = request.state.user
        if not request.state.session:
            form_secret(request)
        for key in ("errors", "values"):  # a form's fields without an error or a value
            if key in values:
                values[key] = collections.defaultdict(str, values[key])
        values.setdefault("notice", NOTICES.get(request.query_params.get("done", "")))
        body = env.get_template(template).render(
            user=user, csrf=csrf_token(request, users), root=request.scope.get("root_path", ""),
            **values)
        response = HTMLResponse(body, status)
        new = getattr(request.state, "new_form_secret", None)
        if new:
            set_cookie(response, request, FORM_COOKIE, new, max_age=3600)
        return response

    def owner(user: UserView) -> str | None:
        return None if user.admin else user.app_id

    @console.exception_handler(CampugridError)
    def _error(request: Request, exc: CampugridError) -> HTMLResponse:
        status = answer(exc).http
        if not hasattr(request.state, "user"):
            request.state.user, request.state.session = None, ""
        return page(request, "message.html", status, title="Not done", message=str(exc))

    # --- sign-in ---------------------------------------------------------------------------

    @public.get("/login", response_class=HTMLResponse)
    def login_page(request: Request, next: str = "", enrolled: bool = False) -> HTMLResponse:
        return page(request, "login.html", next=_safe_next(next, request), error="",
                    name="", notice="You are enrolled: sign in." if enrolled else "")

    @public.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = await request.form()
        name, password, code = (str(form.get(k) or "") for k in ("name", "password", "code"))
        target = _safe_next(str(form.get("next") or ""), request)
        address = request.client.host if request.client else "?"
        try:
            await run_in_threadpool(guard.limit, "sign-in address", address, SIGN_INS_PER_ADDRESS)
            user = await run_in_threadpool(users.login, name.strip(), password, code)
        except (Unauthenticated, RateLimited) as e:
            status = 429 if isinstance(e, RateLimited) else 401
            return page(request, "login.html", status, next=target, error=str(e),
                        name=name.strip()[:100], notice="")
        token, _ = await run_in_threadpool(users.open_session, user)
        response = RedirectResponse(target, 303)
        set_cookie(response, request, SESSION_COOKIE, token)
        response.delete_cookie(FORM_COOKIE, path="/console")
        return response

    @public.get("/enrol", response_class=HTMLResponse)
    def enrol_page(request: Request, token: Annotated[str, Query(max_length=100)] = "") -> HTMLResponse:
        name, secret, uri = users.enrolment(token)
        qr = segno.make(uri, error="m").svg_data_uri(scale=5, border=2)
        return page(request, "enrol.html", token=token, name=name, secret=secret, qr=qr,
                    errors={})

    @public.post("/enrol", response_class=HTMLResponse)
    async def enrol(request: Request) -> Response:
        form = await request.form()
        token, password, again, code = (str(form.get(k) or "")
                                        for k in ("token", "password", "again", "code"))
        name, secret, uri = await run_in_threadpool(users.enrolment, token)
        errors: dict[str, str] = {}
        if password != again:
            errors["again"] = "the two passwords differ"
        else:
            try:
                await run_in_threadpool(users.enrol, token, password, code)
            except InvalidInput as e:
                errors["code" if str(e).startswith("code") else "password"] = str(e)
        if errors:
            qr = segno.make(uri, error="m").svg_data_uri(scale=5, border=2)
            return page(request, "enrol.html", 422, token=token, name=name, secret=secret,
                        qr=qr, errors=errors)
        return RedirectResponse(f"{request.scope.get('root_path', '')}/login?enrolled=1", 303)

    @private.post("/logout")
    def logout(request: Request) -> Response:
        users.close_session(request.state.session)
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", 303)
        response.delete_cookie(SESSION_COOKIE, path="/console")
        return response

    # --- jobs --------------------------------------------------------------------------------

    @private.get("/", response_class=HTMLResponse)
    def jobs(request: Request, state: str = "", name: str = "") -> HTMLResponse:
        user = user_of(request)
        chosen = JobState(state) if state in STATES else None
        found = coord.jobs.list_jobs(chosen, 500, owner(user))
        if name:
            needle = name.lower()
            found = [j for j in found if needle in (j.name or "").lower() or j.id.startswith(needle)]
        found = found[:200]
        reasons = coord.jobs.waiting_reasons(found)
        return page(request, "jobs.html", jobs=list(zip(found, reasons, strict=True)),
                    states=STATES, state=state if chosen else "", name=name,
                    machines=coord.machines.names())

    def job_id_ok(request: Request, ref: str) -> str:
        """The id of the job `ref` names (an id, or a start of one), among the caller's."""
        return coord.jobs.job_id(ref, owner(user_of(request)))

    @private.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job(request: Request, job_id: str) -> HTMLResponse:
        user = user_of(request)
        found = coord.jobs.get(job_id_ok(request, job_id), owner(user))
        [why] = coord.jobs.waiting_reasons([found])
        final = found.state in FINAL
        chunks = coord.jobs.log_tail(found.id, owner(user))  # the end of a long log
        shards = (coord.jobs.shards(found.id, state=None, after=-1, limit=200, owner=owner(user))
                  if found.shards_total else [])
        names = coord.machines.names()
        return page(request, "job.html", job=found, why=why, final=final,
                    events=coord.jobs.events(found.id, owner(user)),
                    machine=names.get(found.machine_id or "", found.machine_id or ""),
                    checkpoints=coord.jobs.checkpoints(found.id, owner(user)),
                    shards=shards, shard_keys=_result_keys(shards),
                    build_log=_tail("".join(c.text for c in chunks if c.stream == "build")),
                    run_log=_tail("".join(c.text for c in chunks if c.stream != "build")),
                    last_log=chunks[-1].id if chunks else 0,
                    spec=json.dumps(_shown_spec(found.spec.to_dict()), indent=2))

    @private.get("/jobs/{job_id}/stream")
    async def stream(request: Request, job_id: str,
                     after: Annotated[int, Query(ge=0, le=2**62)] = 0) -> StreamingResponse:
        """Server-sent events: `log` per new chunk, `state` when it changes, `end` once the job
        has ended and every chunk was sent. A reconnect resumes after Last-Event-ID."""
        user = user_of(request)
        job_id = await run_in_threadpool(job_id_ok, request, job_id)
        await run_in_threadpool(coord.jobs.get, job_id, owner(user))  # NotFound before 200
        last = request.headers.get("last-event-id", "")
        start = int(last) if last.isdigit() and len(last) < 19 else after
        return StreamingResponse(_events(request, job_id, start, owner(user),
                                         request.state.session),
                                 media_type="text/event-stream",
                                 headers={"x-accel-buffering": "no"})

    async def _events(request: Request, job_id: str, after: int, who: str | None,
                      session: str) -> AsyncIterator[str]:
        seen = ""
        told = len(await run_in_threadpool(coord.jobs.events, job_id, who))  # on the page
        names = await run_in_threadpool(coord.machines.names)
        quiet = 0.0
        checked = asyncio.get_running_loop().time()
        while not await request.is_disconnected():
            if asyncio.get_running_loop().time() - checked > SESSION_RECHECK_S:
                if await run_in_threadpool(users.session, session) is None:
                    yield "event: signed-out\ndata: {}\n\n"
                    return
                checked = asyncio.get_running_loop().time()
            found, chunks = await run_in_threadpool(coord.jobs.logs, job_id, after_id=after,
                                                    stream=None, owner=who)
            for c in chunks:
                after = c.id
                yield _sse("log", {"stream": c.stream, "attempt": c.attempt, "text": c.text}, c.id)
            [why] = await run_in_threadpool(coord.jobs.waiting_reasons, [found])
            history = await run_in_threadpool(coord.jobs.events, job_id, who)
            if len(history) > told:  # the attempts table follows too
                rows = [{"at": e.at.strftime("%H:%M:%S"), "iso": e.at.isoformat(),
                         "attempt": e.attempt, "kind": e.kind, "detail": e.detail}
                        for e in history[told:]]
                # No id: the stream's ids are log positions (a reconnect resumes after one).
                yield f"event: history\ndata: {json.dumps(rows)}\n\n"
                told = len(history)
            machine = found.machine_id or ""
            if machine and machine not in names:  # a machine that joined since
                names = await run_in_threadpool(coord.machines.names)
            state = json.dumps({"state": found.state.value, "attempt": found.attempt,
                                "max_attempts": found.max_attempts,
                                "machine": names.get(machine, machine),
                                "reason": found.reason, "waiting": why,
                                "exit_code": found.exit_code})
            if state != seen:
                seen = state
                yield f"event: state\ndata: {state}\n\n"
            if found.state in FINAL and not chunks:
                yield "event: end\ndata: {}\n\n"
                return
            if chunks:
                quiet = 0.0
                continue
            await asyncio.sleep(STREAM_POLL_S)
            quiet += STREAM_POLL_S
            if quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield ": keep-alive\n\n"

    @private.post("/jobs/{job_id}/cancel")
    def cancel(request: Request, job_id: str) -> Response:
        found = coord.jobs.cancel(job_id_ok(request, job_id), owner(user_of(request)))
        return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{found.id}"
                                "?done=cancelled", 303)

    @private.get("/jobs/{job_id}/checkpoints/{epoch}")
    def checkpoint(request: Request, job_id: str,
                   epoch: Annotated[int, PathParam(ge=0, le=2**31)]) -> StreamingResponse:
        """One of the job's checkpoints, for its owner to keep (as the hooks packed it)."""
        found, chunks = coord.jobs.open_checkpoint(job_id_ok(request, job_id), epoch,
                                              owner(user_of(request)))
        return StreamingResponse(chunks, media_type="application/gzip", headers={
            "content-disposition":
                f'attachment; filename="{found.job_id}-epoch-{found.epoch}.tar.gz"'})

    @private.get("/jobs/{job_id}/output")
    def output(request: Request, job_id: str) -> StreamingResponse:
        found, chunks = coord.jobs.open_output(job_id_ok(request, job_id), owner(user_of(request)))
        return StreamingResponse(chunks, media_type="application/gzip", headers={
            "content-disposition": f'attachment; filename="{found.id}-output.tar.gz"'})

    # --- submit ------------------------------------------------------------------------------

    @private.get("/submit", response_class=HTMLResponse)
    def submit_page(request: Request) -> HTMLResponse:
        return page(request, "submit.html", errors={}, values={
            "client_job_id": f"console-{uuid.uuid4()}"})

    @private.post("/submit", response_class=HTMLResponse)
    async def submit(request: Request) -> Response:
        user = user_of(request)
        form = await request.form()  # parsed (and bounded) by the CSRF check
        values = {k: str(form.get(k) or "") for k in forms.TEXT_FIELDS}
        errors: dict[str, str] = {}
        if not user.acknowledged and form.get("acknowledge") != "yes":
            errors["acknowledge"] = ("tick this to go on: providers can read everything a job "
                                     "holds")
        context = None
        try:
            spec = forms.spec_of(form)
            context = await run_in_threadpool(forms.context_of, form,
                                              coord.settings.max_context_bytes)
        except forms.FormErrors as e:
            errors.update(e.fields)
        if errors or context is None:
            if context is not None:
                context.close()
            return page(request, "submit.html", 422, errors=errors, values=values)
        try:
            found, _created = await run_in_threadpool(coord.jobs.submit, spec, context, user.app_id)
        except InvalidInput as e:
            return page(request, "submit.html", 422, errors={forms.field_of(str(e)): str(e)},
                        values=values)
        finally:
            context.close()
        if not user.acknowledged:
            await run_in_threadpool(users.acknowledge, user)
        return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{found.id}", 303)

    # --- machines ----------------------------------------------------------------------------

    def admin(request: Request) -> UserView:
        user = user_of(request)
        if not user.admin:
            raise Forbidden("only admins see and approve machines")
        return user

    @private.get("/machines", response_class=HTMLResponse)
    def machines(request: Request) -> HTMLResponse:
        admin(request)
        found = coord.machines.all()
        order = {"pending": 0, "approved": 1, "revoked": 2}
        found.sort(key=lambda m: (order.get(m.status.value, 3), m.name))
        online = {m.id: m for m in coord.machines.online()}
        recent = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
        drawn: dict[str, list[charts.Chart]] = {}
        for chart in charts.charts(coord.machines.gpu_history(CHART_MINUTES)):
            drawn.setdefault(chart.machine_id, []).append(chart)
        return page(request, "machines.html", machines=found, online=online, recent=recent,
                    charts=drawn, minutes=CHART_MINUTES)

    @private.post("/machines/{ref}/approve")
    def approve(request: Request, ref: str) -> Response:
        admin(request)
        coord.machines.approve(ref)
        return RedirectResponse(f"{request.scope.get('root_path', '')}/machines?done=approved",
                                303)

    @private.post("/machines/{ref}/revoke")
    def revoke(request: Request, ref: str) -> Response:
        admin(request)
        coord.machines.revoke(ref)
        return RedirectResponse(f"{request.scope.get('root_path', '')}/machines?done=revoked",
                                303)

    console.include_router(public)
    console.include_router(private)
    return console


# What a page says after an action redirected to it (?done=…): fixed words, never the query's.
NOTICES = {
    "cancelled": "Job cancelled: its sandbox is stopped, and it will not run again.",
    "approved": "Machine approved: it takes work from now on.",
    "revoked": "Machine revoked: its leases have ended, its jobs are queued again, and "
               "whatever it still sends is refused.",
}


def _result_keys(shards: list[Any], most: int = 8) -> list[str]:
    """The columns of a sharded job's results table: the keys its shards' JSON objects
    have (in first-seen order, at most `most`); none where results are not objects."""
    keys: list[str] = []
    for shard in shards:
        value = _parsed(shard.result)
        if isinstance(value, dict):
            keys += [str(k) for k in value if str(k) not in keys]
    return keys[:most]


def _parsed(result: Any) -> Any:
    if isinstance(result, str):
        try:
            return json.loads(result)
        except ValueError:
            return result
    return result


def _safe_next(target: str, request: Request) -> str:
    """Only a page of this console (no open redirect to elsewhere)."""
    root = str(request.scope.get("root_path", ""))
    if target.startswith(root + "/") and not target.startswith("//") and "\\" not in target \
            and "://" not in target:
        return target
    return root + "/"


def _tail(text: str) -> str:
    """What a page shows of a long log: its end (the whole log: `campugrid logs JOB`)."""
    if len(text) <= LOG_PAGE_CHARS:
        return text
    return f"[... the first {len(text) - LOG_PAGE_CHARS:,} characters: campugrid logs JOB ...]\n" \
        + text[-LOG_PAGE_CHARS:]


def _sse(event: str, data: dict[str, Any], event_id: int) -> str:
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data)}\n\n"


def _shown_spec(spec: dict[str, Any]) -> dict[str, Any]:
    spec = dict(spec)
    spec["env"] = {k: "(hidden)" for k in spec.get("env", {})}
    if len(spec.get("shards") or []) > 20:
        spec["shards"] = f"({len(spec['shards'])} shards)"
    return spec


