"""The researchers' REST API, /v1. Pydantic models live here and stop here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette import formparsers
from starlette.types import ASGIApp, Receive, Scope, Send

from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.views import JobView
from campugrid.protocol import logs
from campugrid.protocol.errors import (
    CampugridError,
    Conflict,
    IllegalTransition,
    InvalidInput,
    NotFound,
    StorageError,
)
from campugrid.protocol.spec import MAX_SPEC_BYTES, JobSpec
from campugrid.protocol.states import JobState

_STATUS: dict[type[CampugridError], int] = {
    InvalidInput: 422, NotFound: 404, Conflict: 409, IllegalTransition: 409, StorageError: 503,
}


class EventOut(BaseModel):
    at: dt.datetime
    attempt: int
    kind: str
    detail: str


class ShardCounts(BaseModel):
    total: int
    queued: int  # waiting for a machine
    running: int
    done: int  # ended, succeeded or failed
    failed: int


class ShardOut(BaseModel):
    index: int
    state: str  # queued, running, succeeded, failed, cancelled
    cost: float
    tries: int  # sessions lost while holding it
    machine_id: str | None
    exit_code: int | None
    result: Any  # the shard's result: its result.json, or its last line of stdout
    reason: str | None
    finished_at: dt.datetime | None


class JobOut(BaseModel):
    id: str
    client_job_id: str | None
    name: str | None
    state: JobState
    attempt: int
    max_attempts: int
    machine_id: str | None
    exit_code: int | None
    reason: str | None
    result: str | None
    has_output: bool
    limits: dict[str, str]
    spec: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime
    waiting_reason: str | None = None  # queued jobs: why no machine has taken it yet
    shards: ShardCounts | None = None  # sharded jobs only
    events: list[EventOut] | None = None

    @classmethod
    def of(cls, job: JobView, events: list[EventOut] | None = None,
           waiting_reason: str | None = None) -> JobOut:
        return cls(
            id=job.id, client_job_id=job.client_job_id, name=job.name, state=job.state,
            attempt=job.attempt, max_attempts=job.max_attempts, machine_id=job.machine_id,
            exit_code=job.exit_code, reason=job.reason, result=job.result,
            has_output=job.output_key is not None, limits=job.limits, spec=_redacted(job),
            created_at=job.created_at, updated_at=job.updated_at, events=events,
            waiting_reason=waiting_reason,
            shards=ShardCounts(
                total=job.shards_total, queued=job.shards_queued, done=job.shards_done,
                failed=job.shards_failed,
                running=job.shards_total - job.shards_queued - job.shards_done)
            if job.shards_total else None,
        )


def _redacted(job: JobView) -> dict[str, Any]:
    """The spec as shown: env values may be tokens, so only their names are served."""
    spec = job.spec.to_dict()
    spec["env"] = {k: "(hidden)" for k in spec["env"]}
    return spec


class LogChunkOut(BaseModel):
    id: int
    attempt: int
    stream: str
    text: str


class LogsOut(BaseModel):
    chunks: list[LogChunkOut]
    next_after: int
    state: JobState


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


def create_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="campugrid", version="1", summary="Sandboxed GPU jobs on idle machines")
    app.add_middleware(AboutJob)

    @app.exception_handler(CampugridError)
    def _domain_error(_req: Request, exc: CampugridError) -> JSONResponse:
        status = next((c for t, c in _STATUS.items() if isinstance(exc, t)), 400)
        return JSONResponse({"detail": str(exc)}, status_code=status)

    def job_id_ok(job_id: str) -> str:
        try:
            return str(uuid.UUID(job_id))
        except ValueError as e:
            raise NotFound(f"no job {job_id!r} (job ids are UUIDs)") from e

    @app.get("/v1/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=201, response_model=JobOut,
              responses={200: {"model": JobOut, "description": "already submitted"}})
    def submit(
        context: Annotated[UploadFile, File(description="tar or tar.gz with a Dockerfile at its top")],
        spec: Annotated[str | None, Form(description="the job spec as JSON (up to 1 MiB)")] = None,
        spec_file: Annotated[UploadFile | None, File(
            description="the job spec as a JSON file, instead of `spec`: up to 16 MiB, room "
                        "for a long list of shards")] = None,
    ) -> Any:
        if spec is not None and spec_file is not None:
            raise InvalidInput("give the spec once: as the `spec` field or as `spec_file`")
        if spec_file is not None:
            text = spec_file.file.read(MAX_SPEC_BYTES + 1)
            parsed = JobSpec.from_json(text)
        else:
            parsed = JobSpec.from_json(spec or "{}")
        limit = coord.settings.max_context_bytes
        data = context.file.read(limit + 1)
        if len(data) > limit:
            raise InvalidInput(f"context: larger than {limit // 1024**2} MiB")
        job, created = coord.submit(parsed, data)
        return JSONResponse(JobOut.of(job).model_dump(mode="json"),
                            status_code=201 if created else 200)

    @app.get("/v1/jobs", response_model=list[JobOut])
    def list_jobs(state: JobState | None = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobOut]:
        jobs = coord.list_jobs(state, limit)
        return [JobOut.of(j, waiting_reason=why)
                for j, why in zip(jobs, coord.waiting_reasons(jobs), strict=True)]

    @app.get("/v1/jobs/{job_id}", response_model=JobOut)
    def get_job(job_id: str) -> JobOut:
        job = coord.get_job(job_id_ok(job_id))
        events = [EventOut(at=e.at, attempt=e.attempt, kind=e.kind, detail=e.detail)
                  for e in coord.job_events(job.id)]
        [why] = coord.waiting_reasons([job])
        return JobOut.of(job, events, why)

    @app.get("/v1/jobs/{job_id}/shards", response_model=list[ShardOut])
    def shards(job_id: str,
               state: Annotated[str | None,
                                Query(pattern="^(queued|running|succeeded|failed|cancelled)$")] = None,
               after: Annotated[int, Query(ge=-1, le=2**31)] = -1,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[ShardOut]:
        """A sharded job's shards in index order, with their results; page with `after`
        (the last index seen)."""
        return [ShardOut(**dataclasses.asdict(v)) for v in coord.shards(
            job_id_ok(job_id), state=state, after=after, limit=limit)]

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobOut)
    def cancel(job_id: str) -> JobOut:
        return JobOut.of(coord.cancel(job_id_ok(job_id)))

    @app.get("/v1/jobs/{job_id}/logs", response_model=LogsOut)
    def logs(job_id: str, after: Annotated[int, Query(ge=0, le=2**62)] = 0,
             stream: Annotated[str | None, Query(pattern="^(build|run)$")] = None) -> LogsOut:
        jid = job_id_ok(job_id)
        chunks = coord.job_logs(jid, after_id=after, stream=stream)
        state = coord.get_job(jid).state
        return LogsOut(
            chunks=[LogChunkOut(id=c.id, attempt=c.attempt, stream=c.stream, text=c.text)
                    for c in chunks],
            next_after=chunks[-1].id if chunks else after, state=state)

    @app.get("/v1/jobs/{job_id}/output", response_class=StreamingResponse,
             responses={200: {"content": {"application/gzip": {}}}})
    def output(job_id: str) -> StreamingResponse:
        job, stream = coord.open_output(job_id_ok(job_id))
        return StreamingResponse(stream, media_type="application/gzip", headers={
            "content-disposition": f'attachment; filename="{job.id}-output.tar.gz"'})

    return app
