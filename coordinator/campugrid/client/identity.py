"""An app's identity on one coordinator: its key file, its id there, and how to reach it.

Kept as `identity.json` (with the key beside it, 0600) under ~/.config/campugrid, or where
CAMPUGRID_IDENTITY points. `Signer` signs every request with it (RFC 9421 over `@method`,
`@target-uri` and `content-digest`, with `created`, a fresh `nonce` and the app id as
`keyid`), through the maintained `http-message-signatures` library. A body too big to hold
(`StreamedBody`: a build context) is digested in a pass of its own, then streamed.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import json
import os
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import http_message_signatures as hms
import httpx
from http_message_signatures import algorithms

from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError

COVERED = ("@method", "@target-uri", "content-digest")


def default_path() -> Path:
    env = os.environ.get("CAMPUGRID_IDENTITY")
    if env:
        return Path(env)
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "campugrid" / "identity.json"


@dataclasses.dataclass(frozen=True)
class Identity:
    server: str  # the coordinator's REST address
    app_id: str  # the signatures' keyid
    name: str
    key_file: Path
    pin: str = ""  # the coordinator's certificate fingerprint (https only)
    admin: bool = False

    @classmethod
    def load(cls, path: Path | None = None) -> Identity:
        path = path or default_path()
        try:
            raw = json.loads(path.read_text())
            key_file = Path(raw["key_file"])
            return cls(str(raw["server"]), str(raw["app_id"]), str(raw["name"]),
                       key_file if key_file.is_absolute() else path.parent / key_file,
                       str(raw.get("pin") or ""), bool(raw.get("admin")))
        except FileNotFoundError as e:
            raise CampugridError(
                f"no identity at {path}: log in first (`campugrid login SERVER --invite CODE`; "
                "`campugrid up` makes an admin identity for its local user)") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CampugridError(f"the identity {path} is damaged ({e}); log in again") from e

    def save(self, path: Path | None = None) -> Path:
        path = path or default_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"server": self.server, "app_id": self.app_id, "name": self.name,
                       "key_file": str(self.key_file), "pin": self.pin,
                       "admin": self.admin}, f, indent=2)
        os.replace(tmp, path)
        return path

    def private_key(self) -> keys.Ed25519PrivateKey:
        return keys.load_private(self.key_file)


@dataclasses.dataclass
class HttpMessage:
    """A request as http-message-signatures reads it, on either side of the wire."""

    method: str
    url: str
    headers: Any


class _OneKey(hms.HTTPSignatureKeyResolver):
    def __init__(self, key: keys.Ed25519PrivateKey) -> None:
        self.key = key

    def resolve_private_key(self, key_id: str) -> Any:
        return self.key


class StreamedBody(httpx.SyncByteStream):
    """A request body that is read from a file as it is sent, never held whole: the Signer
    digests `chunks()` in a first pass, and httpx sends `__iter__` (the same bytes) after."""

    headers: dict[str, str]  # its Content-Type and Content-Length

    def chunks(self) -> Iterator[bytes]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks()


class Signer(httpx.Auth):
    """httpx authentication that signs each request (its body included) with the app key."""

    # Not httpx's own read: a StreamedBody is digested without being read into memory.
    requires_request_body = False

    def __init__(self, app_id: str, key: keys.Ed25519PrivateKey) -> None:
        self.app_id = app_id
        self._signer = hms.HTTPMessageSigner(signature_algorithm=algorithms.ED25519,
                                             key_resolver=_OneKey(key))

    def sign(self, request: httpx.Request, *, created: dt.datetime | None = None,
             nonce: str | None = None) -> None:
        for name in ("signature", "signature-input", "content-digest"):
            request.headers.pop(name, None)
        body: bytes | None = None
        if isinstance(request.stream, StreamedBody):
            digest = hashlib.sha256()
            for chunk in request.stream.chunks():
                digest.update(chunk)
            # RFC 9530's field, as the library writes it for a body it holds.
            request.headers["content-digest"] = (
                f"sha-256=:{base64.b64encode(digest.digest()).decode('ascii')}:")
        else:
            body = request.read()  # the body is signed too (its Content-Digest)
        self._signer.sign(HttpMessage(request.method, str(request.url), request.headers),
                          key_id=self.app_id, created=created or dt.datetime.now(dt.UTC),
                          nonce=nonce or secrets.token_urlsafe(18), label="campugrid",
                          covered_component_ids=COVERED, body=body,
                          use_existing_digest=body is None)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.sign(request)
        yield request
