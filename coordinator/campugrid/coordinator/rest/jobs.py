"""Jobs: submit, list, read, cancel; their shards, logs and output; upload tickets."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse

from campugrid.coordinator.rest.deps import Caller, Coord, owner_of
from campugrid.coordinator.rest.models import (
    CheckpointOut,
    EventOut,
    JobOut,
    LogChunkOut,
    LogsOut,
    ReplicaOut,
    ShardOut,
    UploadIn,
    UploadOut,
)
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import MAX_SPEC_BYTES, JobSpec
from campugrid.protocol.states import JobState

router = APIRouter(prefix="/v1")


@router.post("/jobs", status_code=201, response_model=JobOut,
             responses={200: {"model": JobOut, "description": "already submitted"}})
def submit(
    who: Caller, coord: Coord,
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
    # The upload is spooled to disk by the multipart parser: checked and stored from there.
    job, created = coord.jobs.submit(parsed, context.file, who.id)
    return JSONResponse(JobOut.of(job).model_dump(mode="json"),
                        status_code=201 if created else 200)


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(who: Caller, coord: Coord, state: JobState | None = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobOut]:
    jobs = coord.jobs.list_jobs(state, limit, owner_of(who))
    return [JobOut.of(j, waiting_reason=why)
            for j, why in zip(jobs, coord.jobs.waiting_reasons(jobs), strict=True)]


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, who: Caller, coord: Coord) -> JobOut:
    job = coord.jobs.get(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who))
    events = [EventOut(at=e.at, attempt=e.attempt, kind=e.kind, detail=e.detail)
              for e in coord.jobs.events(job.id, owner_of(who))]
    [why] = coord.jobs.waiting_reasons([job])
    replicas = ([ReplicaOut.of(r, agreed) for r, agreed in coord.jobs.replicas(job)]
                if job.replicas else None)
    checkpoints = [CheckpointOut.of(c) for c in coord.jobs.checkpoints(job.id, owner_of(who))]
    return JobOut.of(job, events, why, replicas, checkpoints)


@router.get("/jobs/{job_id}/shards", response_model=list[ShardOut])
def shards(job_id: str, who: Caller, coord: Coord,
           state: Annotated[str | None,
                            Query(pattern="^(queued|running|succeeded|failed|cancelled)$")] = None,
           after: Annotated[int, Query(ge=-1, le=2**31)] = -1,
           limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[ShardOut]:
    """A sharded job's shards in index order, with their results; page with `after` (the
    last index seen)."""
    return [ShardOut(**dataclasses.asdict(v)) for v in coord.jobs.shards(
        coord.jobs.job_id(job_id, owner_of(who)), state=state, after=after, limit=limit,
        owner=owner_of(who))]


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel(job_id: str, who: Caller, coord: Coord) -> JobOut:
    return JobOut.of(coord.jobs.cancel(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who)))


@router.post("/jobs/{job_id}/rerun", response_model=JobOut, status_code=201)
def rerun(job_id: str, who: Caller, coord: Coord) -> JobOut:
    """The same job again, as a new job: its spec, context and bases (a tainted result's
    remedy)."""
    return JobOut.of(coord.jobs.rerun(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who)))


@router.get("/jobs/{job_id}/logs", response_model=LogsOut)
def logs(job_id: str, who: Caller, coord: Coord, after: Annotated[int, Query(ge=0, le=2**62)] = 0,
         stream: Annotated[str | None, Query(pattern="^(build|run)$")] = None) -> LogsOut:
    job, chunks = coord.jobs.logs(coord.jobs.job_id(job_id, owner_of(who)), after_id=after,
                                  stream=stream, owner=owner_of(who))
    return LogsOut(chunks=[LogChunkOut(id=c.id, attempt=c.attempt, stream=c.stream, text=c.text)
                           for c in chunks],
                   next_after=chunks[-1].id if chunks else after, state=job.state)


@router.get("/jobs/{job_id}/output", response_class=StreamingResponse,
            responses={200: {"content": {"application/gzip": {}}}})
def output(job_id: str, who: Caller, coord: Coord) -> StreamingResponse:
    job, stream = coord.jobs.open_output(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who))
    return StreamingResponse(stream, media_type="application/gzip", headers={
        "content-disposition": f'attachment; filename="{job.id}-output.tar.gz"'})


@router.post("/uploads", status_code=201, response_model=UploadOut)
def upload(body: UploadIn, who: Caller, coord: Coord) -> UploadOut:
    """A ticket for one file that exists nowhere else: good for that file (its size and
    sha256), one job and about ten minutes; the file is deleted after the job."""
    up, url = coord.inputs.create_upload(who.id, body.filename, body.size, body.sha256)
    return UploadOut(ticket=up.ticket, url=url, expires_at=up.expires_at)
