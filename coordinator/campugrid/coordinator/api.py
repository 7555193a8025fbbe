"""The researchers' REST API, /v1. Pydantic models live here and stop here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette import formparsers
from starlette.types import ASGIApp, Receive, Scope, Send

from campugrid.console.app import create_console
from campugrid.coordinator.answers import answer, http_headers
from campugrid.coordinator.apps import AppView
from campugrid.coordinator.auth import Guard, RateLimits, SignedRequests
from campugrid.coordinator.machines import MachineRecord
from campugrid.coordinator.metrics import CONTENT_TYPE, TokenView
from campugrid.coordinator.mirrors import PREFIX as MIRRORS_PREFIX
from campugrid.coordinator.mirrors import MirrorTokens, create_mirrors
from campugrid.coordinator.scheduler import MachineView
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.users import UserView
from campugrid.coordinator.views import JobView
from campugrid.protocol import logs
from campugrid.protocol.errors import (
    CampugridError,
    Forbidden,
    InvalidInput,
    Unauthenticated,
)
from campugrid.protocol.spec import MAX_SPEC_BYTES, JobSpec
from campugrid.protocol.states import JobState


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
    output_files: list[tuple[str, int]] = []  # (path in /output, size), as its agent listed them
    limits: dict[str, str]
    bases: dict[str, str] = {}  # each FROM on a registry -> the digest it was resolved to
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
            has_output=job.output_key is not None, output_files=list(job.output_files),
            limits=job.limits, bases=job.bases,
            spec=_redacted(job),
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


class AppOut(BaseModel):
    id: str
    name: str
    fingerprint: str
    admin: bool
    created_at: dt.datetime
    revoked_at: dt.datetime | None

    @classmethod
    def of(cls, a: AppView) -> AppOut:
        return cls(id=a.id, name=a.name, fingerprint=a.fingerprint, admin=a.admin,
                   created_at=a.created_at, revoked_at=a.revoked_at)


class InviteIn(BaseModel):
    name: str
    admin: bool = False


class InviteOut(BaseModel):
    name: str
    code: str  # shown once: only its digest is kept
    expires_at: dt.datetime
    server: str
    pin: str  # the coordinator certificate's fingerprint, for https and for agents
    command: str  # what the new app runs


class LoginIn(BaseModel):
    invite: str
    public_key: str  # base64 of the new app's 32-byte Ed25519 public key


class MachineOut(BaseModel):
    id: str
    name: str
    status: str  # pending, approved, revoked
    fingerprint: str
    address: str
    registered_at: dt.datetime
    last_seen_at: dt.datetime
    held: str  # why its owner holds it now (paused, a listed program runs); "" takes work
    online: bool  # approved and heard from in the last 30 s (a busy machine is online)
    busy: str  # the job it runs now (an id prefix); "" while it asks for work
    cpus: int  # what one task can be given there, as it last said (0: not said)
    memory_mb: int
    disk_mb: int

    @classmethod
    def of(cls, m: MachineRecord, online: MachineView | None = None) -> MachineOut:
        return cls(id=m.id, name=m.name, status=m.status.value, fingerprint=m.fingerprint,
                   address=m.address, registered_at=m.registered_at, last_seen_at=m.last_seen_at,
                   held=m.held, online=online is not None,
                   busy=online.busy if online is not None else "", cpus=m.cpus,
                   memory_mb=m.memory_mb, disk_mb=m.disk_mb)


class JoinOut(BaseModel):
    grpc_address: str
    pin: str
    command: str


class UserIn(BaseModel):
    name: str
    app: str | None = None  # the app they act as (default: a new app of their own name)
    admin: bool = False  # for a new app: is it an admin


class UserOut(BaseModel):
    name: str
    app: str
    admin: bool
    enrolled: bool
    locked_until: dt.datetime | None

    @classmethod
    def of(cls, u: UserView) -> UserOut:
        return cls(name=u.name, app=u.app_name, admin=u.admin, enrolled=u.enrolled,
                   locked_until=u.locked_until)


class NewUserOut(UserOut):
    link: str  # the one-time enrolment page (shown once: only its digest is kept)
    expires_at: dt.datetime


class ScrapeTokenIn(BaseModel):
    name: str = "prometheus"


class ScrapeTokenOut(BaseModel):
    name: str
    created_by: str  # the admin app's id
    created_at: dt.datetime

    @classmethod
    def of(cls, t: TokenView) -> ScrapeTokenOut:
        return cls(name=t.name, created_by=t.created_by, created_at=t.created_at)


class NewScrapeTokenOut(ScrapeTokenOut):
    token: str  # shown once: only its digest is kept


class UploadIn(BaseModel):
    filename: str  # it becomes /data/<dataset name>/<filename>
    size: int
    sha256: str


class UploadOut(BaseModel):
    ticket: str  # name it in a dataset: {"name": ..., "ticket": ...}
    url: str  # PUT the file here (presigned, until expires_at)
    expires_at: dt.datetime


class SharedFileOut(BaseModel):
    path: str  # inside the share
    size: int
    sha256: str
    machines: int  # approved machines online that share this very file


class ShareOut(BaseModel):
    name: str
    files: list[SharedFileOut]


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


def caller(request: Request) -> AppView:
    """The app that signed this request (auth.SignedRequests checked it before we run)."""
    who = request.state.caller
    assert isinstance(who, AppView)
    return who


Caller = Annotated[AppView, Depends(caller)]


def owner_of(who: AppView) -> str | None:
    """Whose jobs a caller sees: its own, or (admins) everyone's."""
    return None if who.admin else who.id


def admin_only(who: Caller) -> AppView:
    if not who.admin:
        raise Forbidden(f"app {who.name!r} is not an admin: ask an admin to do this")
    return who


Admin = Annotated[AppView, Depends(admin_only)]


def create_app(coord: Coordinator, *, allow_unsigned: bool = False,
               limits: RateLimits | None = None, pin: str = "", grpc_address: str = "",
               public_url: str = "") -> FastAPI:
    """The REST API. `pin` is the coordinator certificate's fingerprint; `grpc_address` and
    `public_url` are how agents and apps reach it (for the join and login commands)."""
    app = FastAPI(title="campugrid", version="1", summary="Sandboxed GPU jobs on idle machines")
    app.add_middleware(AboutJob)
    guard = Guard(coord.limiter, limits)
    meter = coord.metrics
    guard.on_refusal = lambda why: meter.refused("rest", why)
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

    @app.post("/v1/jobs", status_code=201, response_model=JobOut,
              responses={200: {"model": JobOut, "description": "already submitted"}})
    def submit(
        who: Caller,
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

    @app.get("/v1/jobs", response_model=list[JobOut])
    def list_jobs(who: Caller, state: JobState | None = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobOut]:
        jobs = coord.jobs.list_jobs(state, limit, owner_of(who))
        return [JobOut.of(j, waiting_reason=why)
                for j, why in zip(jobs, coord.jobs.waiting_reasons(jobs), strict=True)]

    @app.get("/v1/jobs/{job_id}", response_model=JobOut)
    def get_job(job_id: str, who: Caller) -> JobOut:
        job = coord.jobs.get(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who))
        events = [EventOut(at=e.at, attempt=e.attempt, kind=e.kind, detail=e.detail)
                  for e in coord.jobs.events(job.id, owner_of(who))]
        [why] = coord.jobs.waiting_reasons([job])
        return JobOut.of(job, events, why)

    @app.get("/v1/jobs/{job_id}/shards", response_model=list[ShardOut])
    def shards(job_id: str, who: Caller,
               state: Annotated[str | None,
                                Query(pattern="^(queued|running|succeeded|failed|cancelled)$")] = None,
               after: Annotated[int, Query(ge=-1, le=2**31)] = -1,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[ShardOut]:
        """A sharded job's shards in index order, with their results; page with `after`
        (the last index seen)."""
        return [ShardOut(**dataclasses.asdict(v)) for v in coord.jobs.shards(
            coord.jobs.job_id(job_id, owner_of(who)), state=state, after=after, limit=limit,
            owner=owner_of(who))]

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobOut)
    def cancel(job_id: str, who: Caller) -> JobOut:
        return JobOut.of(coord.jobs.cancel(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who)))

    @app.get("/v1/jobs/{job_id}/logs", response_model=LogsOut)
    def logs(job_id: str, who: Caller, after: Annotated[int, Query(ge=0, le=2**62)] = 0,
             stream: Annotated[str | None, Query(pattern="^(build|run)$")] = None) -> LogsOut:
        job, chunks = coord.jobs.logs(coord.jobs.job_id(job_id, owner_of(who)), after_id=after, stream=stream,
                                     owner=owner_of(who))
        state = job.state
        return LogsOut(
            chunks=[LogChunkOut(id=c.id, attempt=c.attempt, stream=c.stream, text=c.text)
                    for c in chunks],
            next_after=chunks[-1].id if chunks else after, state=state)

    @app.get("/v1/jobs/{job_id}/output", response_class=StreamingResponse,
             responses={200: {"content": {"application/gzip": {}}}})
    def output(job_id: str, who: Caller) -> StreamingResponse:
        job, stream = coord.jobs.open_output(coord.jobs.job_id(job_id, owner_of(who)), owner_of(who))
        return StreamingResponse(stream, media_type="application/gzip", headers={
            "content-disposition": f'attachment; filename="{job.id}-output.tar.gz"'})

    @app.post("/v1/uploads", status_code=201, response_model=UploadOut)
    def upload(body: UploadIn, who: Caller) -> UploadOut:
        """A ticket for one file that exists nowhere else: good for that file (its size and
        sha256), one job and about ten minutes; the file is deleted after the job."""
        up, url = coord.inputs.create_upload(who.id, body.filename, body.size, body.sha256)
        return UploadOut(ticket=up.ticket, url=url, expires_at=up.expires_at)

    @app.get("/v1/shares", response_model=list[ShareOut])
    def shares(_: Caller) -> list[ShareOut]:
        """What approved providers online share: each folder's files by path inside it, size
        and sha256 (name them in a dataset: {"name": ..., "share": ..., "sha256": {path:
        sha256}}), and on how many machines each is. Never where they are on a host."""
        return [ShareOut(name=name, files=[SharedFileOut(path=p, size=size, sha256=sha,
                                                         machines=n)
                                           for (p, size, sha), n in sorted(files.items())])
                for name, files in sorted(coord.machines.shared().items())]

    # --- who may call: apps, invites, machines -------------------------------------------------

    @app.get("/v1/whoami", response_model=AppOut)
    def whoami(who: Caller) -> AppOut:
        return AppOut.of(who)

    @app.post("/v1/login", status_code=201, response_model=AppOut)
    def login(body: LoginIn, request: Request) -> AppOut:
        """Redeem a one-time invite with a public key made on the new app's side."""
        address = (request.client.host if request.client else "?")
        try:
            return AppOut.of(coord.apps.redeem(body.invite.strip(), body.public_key))
        except Unauthenticated as e:
            raise guard.failed(address, "", str(e), why="invite") from e

    @app.get("/v1/apps", response_model=list[AppOut])
    def list_apps(_: Admin) -> list[AppOut]:
        return [AppOut.of(a) for a in coord.apps.all()]

    @app.post("/v1/apps/invites", status_code=201, response_model=InviteOut)
    def invite(body: InviteIn, who: Admin, request: Request) -> InviteOut:
        code, expires = coord.apps.invite(body.name, who, admin=body.admin)
        server = public_url or str(request.base_url).rstrip("/")
        command = f"campugrid login {server} --invite {code}"
        if server.startswith("https://"):
            command += f" --pin {pin}"
        return InviteOut(name=body.name, code=code, expires_at=expires, server=server, pin=pin,
                         command=command)

    @app.post("/v1/apps/{name}/revoke", response_model=AppOut)
    def revoke_app(name: str, who: Admin) -> AppOut:
        return AppOut.of(coord.apps.revoke(name, who))

    @app.get("/v1/machines", response_model=list[MachineOut])
    def list_machines(_: Admin) -> list[MachineOut]:
        online = {v.id: v for v in coord.machines.online()}
        return [MachineOut.of(m, online.get(m.id)) for m in coord.machines.all()]

    @app.get("/v1/machines/join", response_model=JoinOut)
    def join(_: Admin) -> JoinOut:
        return JoinOut(grpc_address=grpc_address, pin=pin,
                       command=f"campugrid agent join {grpc_address} --pin {pin}")

    @app.post("/v1/machines/{ref}/approve", response_model=MachineOut)
    def approve(ref: str, _: Admin) -> MachineOut:
        return MachineOut.of(coord.machines.approve(ref))

    @app.post("/v1/machines/{ref}/revoke", response_model=MachineOut)
    def revoke_machine(ref: str, _: Admin) -> MachineOut:
        machine, _requeued = coord.machines.revoke(ref)
        return MachineOut.of(machine)

    @app.get("/v1/users", response_model=list[UserOut])
    def list_users(_: Admin) -> list[UserOut]:
        return [UserOut.of(u) for u in coord.users.all()]

    @app.post("/v1/users", status_code=201, response_model=NewUserOut)
    def add_user(body: UserIn, _: Admin, request: Request) -> NewUserOut:
        """A person for the web console, with a one-time enrolment link (password and TOTP
        are chosen there)."""
        user, token, expires = coord.users.add(body.name, body.app, admin=body.admin)
        server = public_url or str(request.base_url).rstrip("/")
        return NewUserOut(**UserOut.of(user).model_dump(), expires_at=expires,
                          link=f"{server}/console/enrol?token={token}")

    @app.post("/v1/users/{name}/reset", response_model=NewUserOut)
    def reset_user(name: str, _: Admin, request: Request) -> NewUserOut:
        """A new enrolment link (lost password or authenticator): the old ones stop now."""
        user, token, expires = coord.users.reset(name)
        server = public_url or str(request.base_url).rstrip("/")
        return NewUserOut(**UserOut.of(user).model_dump(), expires_at=expires,
                          link=f"{server}/console/enrol?token={token}")

    @app.delete("/v1/users/{name}")
    def remove_user(name: str, _: Admin) -> dict[str, bool]:
        """The person cannot sign in any more; their app and its jobs stay."""
        return {"removed": coord.users.remove(name)}

    # --- metrics: Prometheus scrapes with a bearer token, admins mint them -----------------------

    @app.get("/metrics", include_in_schema=False)
    def scrape(request: Request) -> Response:
        """Prometheus text format; needs `Authorization: Bearer <scrape token>`, not a
        signature (auth.PUBLIC)."""
        try:
            body = meter.scrape(request.headers.get("authorization", ""))
        except Unauthenticated as e:
            address = request.client.host if request.client else "?"
            refused = guard.failed(address, "", str(e), why="scrape_token")
            return JSONResponse({"detail": str(refused)}, status_code=401,
                                headers={"www-authenticate": 'Bearer realm="campugrid metrics"'})
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/metrics/tokens", response_model=list[ScrapeTokenOut])
    def list_scrape_tokens(_: Admin) -> list[ScrapeTokenOut]:
        return [ScrapeTokenOut.of(t) for t in meter.tokens.all()]

    @app.post("/v1/metrics/tokens", status_code=201, response_model=NewScrapeTokenOut)
    def mint_scrape_token(body: ScrapeTokenIn, who: Admin) -> NewScrapeTokenOut:
        """A scrape token for /metrics, shown this once (Prometheus: `authorization:
        {type: Bearer, credentials_file: …}`)."""
        token, made = meter.tokens.mint(body.name, who.id)
        return NewScrapeTokenOut(**ScrapeTokenOut.of(made).model_dump(), token=token)

    @app.delete("/v1/metrics/tokens/{name}")
    def revoke_scrape_token(name: str, _: Admin) -> dict[str, bool]:
        """/metrics refuses the token from now on."""
        return {"revoked": meter.tokens.revoke(name)}

    app.mount("/console", create_console(coord))
    settings = coord.settings
    if settings.pip_mirror_dir or settings.apt_cache:
        app.mount(MIRRORS_PREFIX, create_mirrors(
            MirrorTokens(settings.registry_dir),
            pypi_dir=Path(settings.pip_mirror_dir) if settings.pip_mirror_dir else None,
            apt_address=settings.apt_cache, machine=coord.machines.get, guard=guard))
    return app

