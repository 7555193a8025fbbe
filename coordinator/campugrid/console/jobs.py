"""A person's jobs: the list, a job's page with its live logs and history (server-sent
events), cancelling, its output and checkpoints, and the submit form."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from campugrid.console import forms
from campugrid.console.gate import user_of
from campugrid.console.pages import csrf, owner_of, pages
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.states import FINAL, JobState

STREAM_POLL_S = 0.5
LOG_PAGE_CHARS = 512 * 1024  # per log on a job's page
SESSION_RECHECK_S = 10.0  # an open log stream ends this soon after its session does
KEEPALIVE_S = 15.0
STATES = [s.value for s in JobState]
private = APIRouter(dependencies=[Depends(csrf)])


@private.get("/", response_class=HTMLResponse)
def jobs(request: Request, state: str = "", name: str = "") -> HTMLResponse:
    site = pages(request)
    user = user_of(request)
    chosen = JobState(state) if state in STATES else None
    found = site.coord.jobs.list_jobs(chosen, 500, owner_of(user))
    if name:
        needle = name.lower()
        found = [j for j in found if needle in (j.name or "").lower() or j.id.startswith(needle)]
    found = found[:200]
    reasons = site.coord.jobs.waiting_reasons(found)
    return site.page(request, "jobs.html", jobs=list(zip(found, reasons, strict=True)),
                     states=STATES, state=state if chosen else "", name=name,
                     machines=site.coord.machines.names())


@private.get("/jobs/{job_id}", response_class=HTMLResponse)
def job(request: Request, job_id: str) -> HTMLResponse:
    site = pages(request)
    user = user_of(request)
    found = site.coord.jobs.get(site.job_id(request, job_id), owner_of(user))
    [why] = site.coord.jobs.waiting_reasons([found])
    final = found.state in FINAL
    chunks = site.coord.jobs.log_tail(found.id, owner_of(user))  # the end of a long log
    shards = (site.coord.jobs.shards(found.id, state=None, after=-1, limit=200, owner=owner_of(user))
              if found.shards_total else [])
    names = site.coord.machines.names()
    replicas = site.coord.jobs.replicas(found) if found.replicas else []
    return site.page(request, "job.html", job=found, why=why, final=final, names=names,
                     replicas=replicas,
                     events=site.coord.jobs.events(found.id, owner_of(user)),
                     machine=names.get(found.machine_id or "", found.machine_id or ""),
                     checkpoints=site.coord.jobs.checkpoints(found.id, owner_of(user)),
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
    site = pages(request)
    user = user_of(request)
    job_id = await run_in_threadpool(site.job_id, request, job_id)
    await run_in_threadpool(site.coord.jobs.get, job_id, owner_of(user))  # NotFound before 200
    last = request.headers.get("last-event-id", "")
    start = int(last) if last.isdigit() and len(last) < 19 else after
    return StreamingResponse(_events(request, job_id, start, owner_of(user),
                                     request.state.session),
                             media_type="text/event-stream",
                             headers={"x-accel-buffering": "no"})


async def _events(request: Request, job_id: str, after: int, who: str | None,
                  session: str) -> AsyncIterator[str]:
    site = pages(request)
    seen = ""
    told = len(await run_in_threadpool(site.coord.jobs.events, job_id, who))  # on the page
    names = await run_in_threadpool(site.coord.machines.names)
    quiet = 0.0
    checked = asyncio.get_running_loop().time()
    while not await request.is_disconnected():
        if asyncio.get_running_loop().time() - checked > SESSION_RECHECK_S:
            if await run_in_threadpool(site.users.session, session) is None:
                yield "event: signed-out\ndata: {}\n\n"
                return
            checked = asyncio.get_running_loop().time()
        found, chunks = await run_in_threadpool(site.coord.jobs.logs, job_id, after_id=after,
                                                stream=None, owner=who)
        for c in chunks:
            after = c.id
            yield _sse("log", {"stream": c.stream, "attempt": c.attempt, "text": c.text}, c.id)
        [why] = await run_in_threadpool(site.coord.jobs.waiting_reasons, [found])
        history = await run_in_threadpool(site.coord.jobs.events, job_id, who)
        if len(history) > told:  # the attempts table follows too
            rows = [{"at": e.at.strftime("%H:%M:%S"), "iso": e.at.isoformat(),
                     "attempt": e.attempt, "kind": e.kind, "detail": e.detail}
                    for e in history[told:]]
            # No id: the stream's ids are log positions (a reconnect resumes after one).
            yield f"event: history\ndata: {json.dumps(rows)}\n\n"
            told = len(history)
        machine = found.machine_id or ""
        if machine and machine not in names:  # a machine that joined since
            names = await run_in_threadpool(site.coord.machines.names)
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
    site = pages(request)
    found = site.coord.jobs.cancel(site.job_id(request, job_id), owner_of(user_of(request)))
    return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{found.id}"
                            "?done=cancelled", 303)


@private.post("/jobs/{job_id}/rerun")
def rerun(request: Request, job_id: str) -> Response:
    """The same job again, as a new job; the browser goes to the new one."""
    site = pages(request)
    new = site.coord.jobs.rerun(site.job_id(request, job_id), owner_of(user_of(request)))
    return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{new.id}"
                            "?done=rerun", 303)


@private.get("/jobs/{job_id}/checkpoints/{epoch}")
def checkpoint(request: Request, job_id: str,
               epoch: Annotated[int, PathParam(ge=0, le=2**31)]) -> StreamingResponse:
    """One of the job's checkpoints, for its owner to keep (as the hooks packed it)."""
    site = pages(request)
    found, chunks = site.coord.jobs.open_checkpoint(site.job_id(request, job_id), epoch,
                                                    owner_of(user_of(request)))
    return StreamingResponse(chunks, media_type="application/gzip", headers={
        "content-disposition":
            f'attachment; filename="{found.job_id}-epoch-{found.epoch}.tar.gz"'})


@private.get("/jobs/{job_id}/output")
def output(request: Request, job_id: str) -> StreamingResponse:
    site = pages(request)
    found, chunks = site.coord.jobs.open_output(site.job_id(request, job_id),
                                                owner_of(user_of(request)))
    return StreamingResponse(chunks, media_type="application/gzip", headers={
        "content-disposition": f'attachment; filename="{found.id}-output.tar.gz"'})


# --- submit ------------------------------------------------------------------------------


@private.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request) -> HTMLResponse:
    site = pages(request)
    return site.page(request, "submit.html", errors={}, values={
        "client_job_id": f"console-{uuid.uuid4()}"})


@private.post("/submit", response_class=HTMLResponse)
async def submit(request: Request) -> Response:
    site = pages(request)
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
                                          site.coord.settings.max_context_bytes)
    except forms.FormErrors as e:
        errors.update(e.fields)
    if errors or context is None:
        if context is not None:
            context.close()
        return site.page(request, "submit.html", 422, errors=errors, values=values)
    try:
        found, _created = await run_in_threadpool(site.coord.jobs.submit, spec, context, user.app_id)
    except InvalidInput as e:
        return site.page(request, "submit.html", 422, errors={forms.field_of(str(e)): str(e)},
                         values=values)
    finally:
        context.close()
    if not user.acknowledged:
        await run_in_threadpool(site.users.acknowledge, user)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{found.id}", 303)


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
