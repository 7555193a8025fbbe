"""Signing an app's requests with its identity (protocol/identities.py: its key file, its id
there, and how to reach it, kept as `identity.json` under ~/.config/campugrid or where
CAMPUGRID_IDENTITY points). `Signer` signs every request with it (RFC 9421 over `@method`,
`@target-uri` and `content-digest`, with `created`, a fresh `nonce` and the app id as
`keyid`), through the maintained `http-message-signatures` library. A body too big to hold
(`StreamedBody`: a build context) is digested in a pass of its own, then streamed.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import secrets
from collections.abc import Generator, Iterator
from typing import Any

import http_message_signatures as hms
import httpx
from http_message_signatures import algorithms

from campugrid.protocol import keys
from campugrid.protocol.identities import COVERED, HttpMessage, Identity, default_path

__all__ = ["Identity", "Signer", "StreamedBody", "default_path"]  # the SDK's names, as before


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
