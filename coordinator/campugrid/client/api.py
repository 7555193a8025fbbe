"""The REST API's client: what the CLI uses, and what an app imports to submit and watch
jobs (`from campugrid.client import Api`). Every request is signed with the app's key."""

from __future__ import annotations

import hashlib
import io
import ssl
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from campugrid.client.identity import Identity, Signer
from campugrid.protocol import pins
from campugrid.protocol.errors import CampugridError, InvalidInput, NotFound
from campugrid.protocol.spec import JobSpec

FINAL = {"succeeded", "failed", "cancelled"}


class ApiError(CampugridError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{detail} (HTTP {status})")
        self.status = status
        self.detail = detail


def tar_folder(folder: Path) -> bytes:
    if not (folder / "Dockerfile").is_file():
        raise InvalidInput(f"{folder}: no Dockerfile in this folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(folder.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(folder)), recursive=False)
    return buf.getvalue()


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
        self.http = httpx.Client(base_url=server.rstrip("/"), timeout=timeout, auth=auth,
                                 verify=verify)
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

    def submit(self, context: bytes, spec: JobSpec, retries: int = 5) -> dict[str, Any]:
        """Submit; retried on transport errors with the same client_job_id, so never twice."""
        if spec.client_job_id is None:
            import dataclasses
            spec = dataclasses.replace(spec, client_job_id=f"cli-{uuid.uuid4()}")
        last: Exception | None = None
        for attempt in range(retries):
            try:
                resp = self.http.post("/v1/jobs", files={
                    "context": ("context.tar.gz", context),
                    "spec_file": ("spec.json", spec.to_json().encode(), "application/json")})
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

    def logs(self, job_id: str, after: int = 0) -> dict[str, Any]:
        return dict(self._check(self._send("GET", f"/v1/jobs/{job_id}/logs", params={"after": after})))

    def follow_logs(self, job_id: str, poll_s: float = 0.5) -> Iterator[dict[str, Any]]:
        """Yield log chunks as they arrive until the job is final and nothing is left."""
        after = 0
        while True:
            page = self.logs(job_id, after)
            yield from page["chunks"]
            after = page["next_after"]
            if page["state"] in FINAL and not page["chunks"]:
                return
            if not page["chunks"]:
                time.sleep(poll_s)

    def wait(self, job_id: str, timeout_s: float = 3600, poll_s: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["state"] in FINAL or time.monotonic() > deadline:
                return job
            time.sleep(poll_s)

    def output(self, job_id: str) -> bytes:
        resp = self._send("GET", f"/v1/jobs/{job_id}/output")
        if resp.status_code >= 400:
            self._check(resp)
        return resp.content

    def upload(self, path: Path) -> str:
        """Send a file that exists nowhere else for one job: its ticket, to name in a dataset
        ({"name": ..., "ticket": ...}); good for about ten minutes, deleted after the job."""
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1024 * 1024), b""):
                digest.update(chunk)
                size += len(chunk)
        ticket = dict(self._check(self._send("POST", "/v1/uploads", json={
            "filename": path.name, "size": size, "sha256": digest.hexdigest()})))
        with open(path, "rb") as f:
            try:
                resp = httpx.put(ticket["url"], content=f, timeout=600,
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

    def approve_machine(self, ref: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/machines/{ref}/approve")))

    def revoke_machine(self, ref: str) -> dict[str, Any]:
        return dict(self._check(self._send("POST", f"/v1/machines/{ref}/revoke")))
