"""The REST API's client: what the CLI uses, and what an app imports to submit and watch
jobs (`from campugrid.client import Api`). Every request is signed with the app's key.
Build contexts and outputs go through files in chunks: a tarball is never held whole."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import secrets
import ssl
import stat
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from campugrid.client.identity import Signer, StreamedBody
from campugrid.protocol import pins
from campugrid.protocol.errors import CampugridError, InvalidInput, NotFound
from campugrid.protocol.identities import Identity
from campugrid.protocol.spec import JobSpec

FINAL = {"succeeded", "failed", "cancelled"}
CHUNK = 1024 * 1024
# Told of a transfer as it goes: bytes done so far, of how many (None: not known yet).
Progress = Callable[[int, int | None], None]


class ApiError(CampugridError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{detail} (HTTP {status})")
        self.status = status
        self.detail = detail


class JobFailed(CampugridError):
    """Api.wait: the job ended without succeeding (failed or cancelled); `job` is its
    record, with its reason and history."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(f"job {job['id']} {job['state']}: {job.get('reason') or 'no reason given'}")
        self.job = job


class _Counted:
    """A member's file as tarfile reads it, its bytes counted on the way."""

    def __init__(self, f: BinaryIO, count: Callable[[int], None]) -> None:
        self.f = f
        self.count = count

    def read(self, n: int = -1) -> bytes:
        chunk = self.f.read(n)
        self.count(len(chunk))
        return chunk


def context_paths(folder: Path) -> list[Path]:
    """What of `folder` goes into its build context: everything but what its .dockerignore
    leaves out, read as Docker reads it (docker-py's own matcher; the Dockerfile always
    goes), in a stable order."""
    from docker.utils.build import exclude_paths

    patterns: list[str] = []
    ignore = folder / ".dockerignore"
    if ignore.is_file():  # as docker-py's build reads it: no blank lines, no comments
        patterns = [line.strip() for line in ignore.read_text().splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    return sorted(folder / p for p in exclude_paths(str(folder), patterns, "Dockerfile"))


def pack_folder(folder: Path, out: BinaryIO, progress: Progress | None = None,
                limit: int | None = None, dockerfile: Path | None = None) -> int:
    """Write `folder` as a tar.gz build context to `out` (a file: a temporary one for a big
    folder), one file at a time, without what .dockerignore leaves out; `progress` counts the
    folder's bytes packed. `dockerfile`: a Dockerfile of another name or place, packed as the
    context's Dockerfile. InvalidInput as soon as the tar.gz is larger than `limit` (the
    coordinator's, so that nothing is uploaded to be refused). Returns the tar.gz's size."""
    if dockerfile is not None and not dockerfile.is_file():
        raise InvalidInput(f"{dockerfile}: no such file")
    if dockerfile is None and not (folder / "Dockerfile").is_file():
        raise InvalidInput(f"{folder}: no Dockerfile in this folder (or name one with --file)")
    paths = context_paths(folder)
    if dockerfile is not None:
        paths = [p for p in paths if p != folder / "Dockerfile"]
    total = sum(st.st_size for st in map(os.lstat, paths) if stat.S_ISREG(st.st_mode))
    done = 0

    def count(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)
        if limit is not None and out.tell() - start > limit:
            raise InvalidInput(
                f"{folder}: the build context is larger than the coordinator takes "
                f"({limit // 1024**2} MiB compressed); leave big files out with a "
                ".dockerignore, and send data as a dataset (`submit --upload NAME=FILE`)")

    start = out.tell()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for p in paths:  # as tar.add(p, recursive=False) does, with the bytes counted
            info = tar.gettarinfo(p, arcname=str(p.relative_to(folder)))
            if info is None:
                continue  # a socket or the like: nothing a build can use
            if info.isreg():
                with open(p, "rb") as f:
                    tar.addfile(info, _Counted(f, count))
            else:
                tar.addfile(info)
        if dockerfile is not None:
            text = dockerfile.read_bytes()
            info = tarfile.TarInfo("Dockerfile")
            info.size, info.mode = len(text), 0o644
            info.mtime = int(dockerfile.stat().st_mtime)
            tar.addfile(info, io.BytesIO(text))
    return out.tell() - start


def tar_folder(folder: Path) -> bytes:
    """The build context in memory, for small folders; `pack_folder` writes it to a file."""
    buf = io.BytesIO()
    pack_folder(folder, buf)
    return buf.getvalue()


class _SubmitBody(StreamedBody):
    """POST /v1/jobs as multipart/form-data: the context read from its file as it is sent
    (twice: once for the signature's digest, once onto the wire), then the spec."""

    def __init__(self, context: BinaryIO, spec: bytes, progress: Progress | None) -> None:
        boundary = secrets.token_hex(16)
        self.head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"context\"; "
                     'filename="context.tar.gz"\r\nContent-Type: application/gzip\r\n\r\n').encode()
        self.tail = (f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"spec_file\"; "
                     'filename="spec.json"\r\nContent-Type: application/json\r\n\r\n').encode() \
            + spec + f"\r\n--{boundary}--\r\n".encode()
        self.context = context
        self.start = context.tell()
        self.size = context.seek(0, io.SEEK_END) - self.start
        self.length = len(self.head) + self.size + len(self.tail)
        self.headers = {"content-type": f"multipart/form-data; boundary={boundary}",
                        "content-length": str(self.length)}
        self.progress = progress

    def chunks(self) -> Iterator[bytes]:
        self.context.seek(self.start)
        yield self.head
        left = self.size
        while left > 0:
            chunk = self.context.read(min(CHUNK, left))
            if not chunk:
                raise CampugridError("the build context file shrank while it was sent; "
                                     "submit again")
            left -= len(chunk)
            yield chunk
        yield self.tail

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        for chunk in self.chunks():
            sent += len(chunk)
            yield chunk
            if self.progress is not None:
                self.progress(sent, self.length)


@dataclasses.dataclass(frozen=True)
class Download:
    path: Path
    size: int
    sha256: str


KEEPALIVE_S = 2.0  # below uvicorn's 5 s (Api.__init__)
IDEMPOTENT = frozenset({"GET", "HEAD"})


class Api:
    """The coordinator at `server`, as the app `identity` (None: unsigned, which only a
    coordinator that opted in on its loopback address accepts)."""

    def __init__(self, server: str | None = None, identity: Identity | None = None,
                 timeout: float = 60) -> None:
        server = server or (identity.server if identity else "")
        if not server:
            raise InvalidInput("no coordinator address: give --server or log in first")
        verify: ssl.SSLContext | bool = True
        if server.startswith("https://") and identity is not None and identity.pin:
            host, port = pins.split_address(server.removeprefix("https://").split("/")[0], 443)
            verify = pins.client_context(pins.fetch_pinned(host, port, identity.pin))
        auth = Signer(identity.app_id, identity.private_key()) if identity else None
        # An idle connection is dropped before the coordinator's server drops it (uvicorn
        # closes one idle for 5 s): a request sent on one the server is closing at that moment
        # is lost ("Server disconnected without sending a response").
        self.http = httpx.Client(base_url=server.rstrip("/"), timeout=timeout, auth=auth,
                                 verify=verify, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        self.server = server
        self.identity = identity

    @classmethod
    def from_identity(cls, path: Path | None = None, server: str | None = None,
                      timeout: float = 60) -> Api:
        """The app whose identity is at `path` (default: ~/.config/campugrid/identity.json
        or $CAMPUGRID_IDENTITY)."""
        identity = Identity.load(path)
        return cls(server or identity.server, identity, timeout)

    def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            try:
                return self.http.request(method, url, **kw)
            except httpx.RemoteProtocolError:
                # A kept-alive connection the server closed as the request went out: a read is
                # asked again once, on a new connection (signed afresh); a write is not, since
                # it may have been done.
                if method not in IDEMPOTENT:
                    raise
                return self.http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise CampugridError(f"cannot reach the coordinator at {self.server} "
                                 f"({type(e).__name__}); is it running?") from e

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                body = resp.json()
                detail = body.get("detail", resp.text) if isinstance(body, dict) else resp.text
            except ValueError:
                detail = resp.text
            if resp.status_code == 404:
                raise NotFound(str(detail))
            raise ApiError(resp.status_code, str(detail))
        return resp.json()

    def max_context_bytes(self) -> int | None:
        """The largest build context (compressed) the coordinator takes; None if it does not
        say (an older one)."""
        said = self._check(self._send("GET", "/v1/health")).get("max_context_bytes")
        return int(said) if isinstance(said, int) else None

    def submit(self, context: bytes | BinaryIO | Path, spec: JobSpec | dict[str, Any] | None = None,
               retries: int = 5, progress: Progress | None = None) -> dict[str, Any]:
        """Submit; retried on transport errors with the same client_job_id, so never twice.
        `context` is a folder with a Dockerfile (packed here, as `campugrid submit` packs
        it: .dockerignore honoured, refused before any upload if too big), or the tar.gz:
        bytes, an open file (from its position) or a path; a file is streamed, never read
        whole. `spec`: a JobSpec, or the same as plain values (JobSpec.from_dict).
        `progress` counts the request's bytes sent."""
        if spec is None or isinstance(spec, dict):
            spec = JobSpec.from_dict(spec or {})
        if spec.client_job_id is None:
            spec = dataclasses.replace(spec, client_job_id=f"cli-{uuid.uuid4()}")
        last: Exception | None = None
        with contextlib.ExitStack() as stack:
            if isinstance(context, bytes):
                file: BinaryIO = io.BytesIO(context)
            elif isinstance(context, Path) and context.is_dir():
                file = stack.enter_context(tempfile.TemporaryFile(prefix="campugrid-context-"))
                pack_folder(context, file, limit=self.max_context_bytes())
                file.seek(0)
            elif isinstance(context, Path):
                file = stack.enter_context(open(context, "rb"))
            else:
                file = context
            body = _SubmitBody(file, spec.to_json().encode(), progress)
            for attempt in range(retries):
                built = self.http.build_request("POST", "/v1/jobs", headers=body.headers)
                request = httpx.Request("POST", built.url, headers=built.headers, stream=body,
                                        extensions=built.extensions)
                try:
                    resp = self.http.send(request)
                except httpx.TransportError as e:
                    last = e
                    time.sleep(min(8, 0.5 * 2**attempt))
                    continue
                return dict(self._check(resp))
        raise CampugridError(f"cannot reach the coordinator at {self.server} "
                             f"({type(last).__name__}); is it running?")

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self._check(self._send("GET", f"/v1/jobs/{job_id}")))

    def jobs(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        return list(self._check(self._send("GET", "/v1/jobs", params=params)))

    def shards(self, job_id: str, state: str | None = None) -> Iterator[dict[str, Any]]:
        """Every shard of a sharded job, in index order (paged)."""
        after = -1
        while True:
            params: dict[str, Any] = {"after": after, "limit": 1000}
            if state:
                params["state"] = state
            page = list(self._check(self._send("GET", f"/v1/jobs/{job_id}/shards", params=params)))
            yield from page
            if len(page) < 1000:
                return
            after = page[-1]["index"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/jobs/{job_id}/cancel")))

    def rerun(self, job_id: str) -> dict[str, Any]:
        """The same job again, as a new job (its spec, context and bases): the new job."""
        return dict(self._check(self._send("POST", f"/v1/jobs/{job_id}/rerun")))

    def logs(self, job_id: str, after: int = 0) -> dict[str, Any]:
        return dict(self._check(self._send("GET", f"/v1/jobs/{job_id}/logs", params={"after": after})))

    def follow_logs(self, job_id: str, poll_s: float = 0.5,
                    on_state: Callable[[str], None] | None = None) -> Iterator[dict[str, Any]]:
        """Yield log chunks as they arrive until the job is final and nothing is left;
        `on_state` hears the job's state with every page."""
        after = 0
        while True:
            page = self.logs(job_id, after)
            if on_state is not None:
                on_state(page["state"])
            yield from page["chunks"]
            after = page["next_after"]
            if page["state"] in FINAL and not page["chunks"]:
                return
            if not page["chunks"]:
                time.sleep(poll_s)

    def wait(self, job_id: str, timeout_s: float = 3600, poll_s: float = 0.5, *,
             check: bool = True) -> dict[str, Any]:
        """The job once it has ended. With `check` (the default), JobFailed unless it
        succeeded; without, whatever its end. TimeoutError if it has not ended in
        `timeout_s` (the job goes on)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["state"] in FINAL:
                if check and job["state"] != "succeeded":
                    raise JobFailed(job)
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job['id']} is still {job['state']} after "
                                   f"{timeout_s:g} s (it goes on: `campugrid status "
                                   f"{job['id'][:8]}`)")
            time.sleep(poll_s)

    def output(self, job_id: str) -> bytes:
        """The job's /output folder as a tar.gz, in memory: `download_output` for a big one."""
        resp = self._send("GET", f"/v1/jobs/{job_id}/output")
        if resp.status_code >= 400:
            self._check(resp)
        return resp.content

    def download_output(self, job_id: str, path: Path,
                        progress: Progress | None = None) -> Download:
        """Stream the job's /output tar.gz to `path`, through `path`.part beside it: a broken
        download leaves nothing under the name."""
        part = path.with_name(path.name + ".part")
        digest, size, answered = hashlib.sha256(), 0, False
        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/output") as resp:
                answered = True
                if resp.status_code >= 400:
                    resp.read()
                    self._check(resp)
                length = resp.headers.get("content-length")
                total = int(length) if length and length.isdigit() else None
                with open(part, "wb") as f:
                    for chunk in resp.iter_bytes(CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        if progress is not None:
                            progress(size, total)
                if progress is not None:
                    progress(size, size)  # the total is known now, if it was not before
            os.replace(part, path)
        except httpx.TransportError as e:
            if not answered:
                raise CampugridError(f"cannot reach the coordinator at {self.server} "
                                     f"({type(e).__name__}); is it running?") from e
            raise CampugridError(
                f"the download from {self.server} broke off after {size} bytes "
                f"({type(e).__name__}); run it again") from e
        finally:
            part.unlink(missing_ok=True)
        return Download(path, size, digest.hexdigest())

    def upload(self, path: Path, progress: Progress | None = None) -> str:
        """Send a file that exists nowhere else for one job: its ticket, to name in a dataset
        ({"name": ..., "ticket": ...}); good for about ten minutes, deleted after the job.
        The file is streamed; `progress` counts its bytes sent."""
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1024 * 1024), b""):
                digest.update(chunk)
                size += len(chunk)
        ticket = dict(self._check(self._send("POST", "/v1/uploads", json={
            "filename": path.name, "size": size, "sha256": digest.hexdigest()})))
        def chunks(f: BinaryIO) -> Iterator[bytes]:
            sent = 0
            for chunk in iter(lambda: f.read(CHUNK), b""):
                yield chunk
                sent += len(chunk)
                if progress is not None:
                    progress(sent, size)

        with open(path, "rb") as f:
            try:
                resp = httpx.put(ticket["url"], content=chunks(f), timeout=600,
                                 headers={"content-length": str(size)})
            except httpx.TransportError as e:
                raise CampugridError(f"cannot upload {path} to the coordinator's storage "
                                     f"({type(e).__name__})") from e
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, f"storage refused the upload of {path}")
        return str(ticket["ticket"])

    def shares(self) -> list[dict[str, Any]]:
        """What providers online share: folders by name, files by path inside, size, sha256."""
        return list(self._check(self._send("GET", "/v1/shares")))

    # --- apps and machines (admins) --------------------------------------------------------

    def whoami(self) -> dict[str, Any]:
        return dict(self._check(self._send("GET", "/v1/whoami")))

    def apps(self) -> list[dict[str, Any]]:
        return list(self._check(self._send("GET", "/v1/apps")))

    def invite(self, name: str, admin: bool = False) -> dict[str, Any]:
        return dict(self._check(self._send("POST", "/v1/apps/invites",
                                           json={"name": name, "admin": admin})))

    def revoke_app(self, name: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/apps/{name}/revoke")))

    def machines(self) -> list[dict[str, Any]]:
        return list(self._check(self._send("GET", "/v1/machines")))

    def join_command(self) -> dict[str, Any]:
        return dict(self._check(self._send("GET", "/v1/machines/join")))

    def approve_machine(self, ref: str, owner: str | None = None) -> dict[str, Any]:
        params = {"owner": owner} if owner is not None else None
        return dict(self._check(self._send("POST", f"/v1/machines/{ref}/approve",
                                           params=params)))

    def revoke_machine(self, ref: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/machines/{ref}/revoke")))

    def users(self) -> list[dict[str, Any]]:
        return list(self._check(self._send("GET", "/v1/users")))

    def reset_user(self, name: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/users/{name}/reset")))

    def remove_user(self, name: str) -> dict[str, Any]:
        return dict(self._check(self._send("DELETE", f"/v1/users/{name}")))

    def add_user(self, name: str, app: str | None = None, admin: bool = False) -> dict[str, Any]:
        """A console user and their one-time enrolment link (`link`)."""
        return dict(self._check(self._send("POST", "/v1/users",
                                           json={"name": name, "app": app, "admin": admin})))

    # --- metrics scrape tokens (admins) -----------------------------------------------------

    def scrape_tokens(self) -> list[dict[str, Any]]:
        return list(self._check(self._send("GET", "/v1/metrics/tokens")))

    def mint_scrape_token(self, name: str = "prometheus") -> dict[str, Any]:
        """A bearer token for /metrics (`token`), shown once."""
        return dict(self._check(self._send("POST", "/v1/metrics/tokens", json={"name": name})))

    def revoke_scrape_token(self, name: str) -> dict[str, Any]:
        return dict(self._check(self._send("DELETE", f"/v1/metrics/tokens/{name}")))
