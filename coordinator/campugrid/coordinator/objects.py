"""Object storage through the S3 API (minio SDK): build contexts, outputs, datasets.

Agents never hold S3 credentials: the coordinator hands them short-lived presigned URLs for
exactly the objects one task needs.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import hashlib
import io
import os
import secrets
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from typing import BinaryIO, Protocol

import certifi
import urllib3
from minio import Minio
from minio.commonconfig import CopySource
from minio.error import MinioException, S3Error
from urllib3.exceptions import HTTPError

from campugrid.coordinator.presign import Presigner, signed_region
from campugrid.protocol.errors import InvalidInput, StorageError

_FAILURES = (MinioException, HTTPError, OSError, ValueError)
PART_BYTES = 5 * 1024**2  # a streamed upload goes in parts of this size (S3's least)
ADDRESSING = ("auto", "path", "virtual")  # auto: what the SDK picks for the endpoint
CALL_TTL = dt.timedelta(minutes=15)  # the URLs our own S3 calls are sent on
MAX_REPLY = 1024**2  # an S3 reply to one of those calls, read at most
# CompleteMultipartUpload refusals that mean the parts or upload named were wrong (the agent's
# report), not that the store failed.
NAMED_WRONGLY = frozenset({"NoSuchUpload", "InvalidPart", "InvalidPartOrder", "EntityTooSmall",
                           "MalformedXML"})


class S3Refusal(Exception):
    """S3 answered one of our own calls with an error (its code and message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message} (HTTP {status})")
        self.status, self.code, self.message = status, code, message


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectStore(Protocol):
    """What the coordinator does with object storage (S3Store speaks it over the S3 API;
    tests/integration/test_objects.py runs it against a real S3 server). The store failing
    is a StorageError; a bucket, key or upload a user named wrongly is InvalidInput."""

    bucket: str  # the platform's own bucket: contexts, outputs, checkpoints

    def close(self) -> None: ...
    def ensure_bucket(self) -> None: ...
    def put_bytes(self, key: str, data: bytes, bucket: str | None = None) -> None: ...
    def put_file(self, key: str, data: BinaryIO, size: int) -> None:
        """`size` bytes from the file's start, streamed."""
        ...
    def stream(self, key: str, chunk: int = 1024 * 1024) -> Iterator[bytes]: ...
    def exists(self, key: str) -> bool: ...
    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[ObjectInfo]:
        """The objects under `prefix` of `bucket` (a dataset's), recursively; one past
        `limit` only says there are more."""
        ...

    def presign_get(self, key: str, ttl: dt.timedelta, bucket: str | None = None) -> str: ...
    def presign_put(self, key: str, ttl: dt.timedelta) -> str: ...
    def delete(self, key: str) -> None: ...
    def copy(self, key: str, to: str) -> None:
        """A copy of the object under another key, made by the store (nothing downloaded):
        what an agent's presigned URL for `key` can no longer change."""
        ...

    def begin_multipart(self, key: str) -> str:
        """A multipart upload of `key` (a checkpoint): its upload id."""
        ...

    def presign_part(self, key: str, upload_id: str, number: int, ttl: dt.timedelta) -> str: ...
    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> None: ...
    def abort_multipart(self, key: str, upload_id: str) -> None: ...
    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256 hex) of the stored object, read back."""
        ...


class S3Store:
    """ObjectStore over any S3 server. `region` empty: the one the endpoint names (an AWS
    regional host), else the platform bucket's, asked of the server once; `addressing`
    "auto" is the SDK's choice for the endpoint (virtual-host on AWS, path elsewhere)."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str,
                 *, secure: bool = False, region: str = "", addressing: str = "auto") -> None:
        if addressing not in ADDRESSING:
            raise ValueError(f"S3 addressing {addressing!r}: expected one of {', '.join(ADDRESSING)}")
        self.bucket = bucket
        self._endpoint, self._secure, self._addressing = endpoint, secure, addressing
        self._access_key, self._secret_key, self._region = access_key, secret_key, region
        # Ours, handed to the SDK (with its own defaults), so that close() needs none of the
        # SDK's private parts and our own calls below share its connections.
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=300, read=300), maxsize=10, cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]))
        self._sdk(region)  # a bad endpoint or region is refused now, without a request
        self._ready: tuple[Minio, Presigner, str] | None = None
        self._settle = threading.Lock()

    def _sdk(self, region: str) -> Minio:
        client = Minio(self._endpoint, self._access_key, self._secret_key, secure=self._secure,
                       region=region or None, http_client=self._http)
        # The SDK's public switches (unannotated in its source).
        if self._addressing == "path":
            client.disable_virtual_style_endpoint()  # type: ignore[no-untyped-call]
        elif self._addressing == "virtual":
            client.enable_virtual_style_endpoint()  # type: ignore[no-untyped-call]
        return client

    def _settled(self) -> tuple[Minio, Presigner, str]:
        """The SDK client with its region fixed, and our presigner on it. Knowing no region, the
        SDK would ask the server for each bucket's location on the bucket's first use, a lease's
        presign included; so the region is settled once, on this store's first use (build()
        calls ensure_bucket at start), and every bucket is signed for it: one store, one region."""
        ready = self._ready
        if ready is None:
            with self._settle:
                ready = self._ready
                if ready is None:
                    region = self._region or self._ask_region()
                    client = self._sdk(region)
                    presigner = Presigner(client, self._access_key, self._secret_key)
                    ready = self._ready = (client, presigner, region)
        return ready

    def _ask_region(self) -> str:
        """The region the SDK itself would sign our bucket for: the endpoint's when it names
        one (no request), else the bucket's location from the server (one request)."""
        try:
            return signed_region(self._sdk("").get_presigned_url("GET", self.bucket, "region",
                                                                 expires=CALL_TTL))
        except S3Error:
            # No bucket yet (the SDK then creates it in us-east-1), or a server that will not
            # say: us-east-1, the SDK's default; CAMPUGRID_S3_REGION says otherwise.
            return "us-east-1"
        except _FAILURES as e:
            raise StorageError(f"object storage unreachable: {e}") from e

    @property
    def client(self) -> Minio:
        return self._settled()[0]

    @property
    def presigner(self) -> Presigner:
        return self._settled()[1]

    @property
    def region(self) -> str:
        return self._settled()[2]

    def close(self) -> None:
        self._http.clear()

    def ensure_bucket(self) -> None:
        try:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)
        except S3Error as e:
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise StorageError(f"cannot create bucket {self.bucket}: {e}") from e
        except _FAILURES as e:
            raise StorageError(f"object storage unreachable: {e}") from e

    def put_bytes(self, key: str, data: bytes, bucket: str | None = None) -> None:
        try:
            self.client.put_object(bucket or self.bucket, key, io.BytesIO(data), len(data))
        except _FAILURES as e:
            raise StorageError(f"cannot store {key}: {e}") from e

    def put_file(self, key: str, data: BinaryIO, size: int) -> None:
        data.seek(0)
        try:
            self.client.put_object(self.bucket, key, data, size, part_size=PART_BYTES,
                                   num_parallel_uploads=1)
        except _FAILURES as e:
            raise StorageError(f"cannot store {key}: {e}") from e

    def get_bytes(self, key: str, bucket: str | None = None) -> bytes:
        try:
            resp = self.client.get_object(bucket or self.bucket, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()
        except S3Error as e:
            if e.code == "NoSuchKey":
                raise InvalidInput(f"no object {key}") from e
            raise StorageError(f"cannot read {key}: {e}") from e
        except _FAILURES as e:
            raise StorageError(f"cannot read {key}: {e}") from e

    def stream(self, key: str, chunk: int = 1024 * 1024) -> Iterator[bytes]:
        try:
            resp = self.client.get_object(self.bucket, key)
        except _FAILURES as e:
            raise StorageError(f"cannot read {key}: {e}") from e
        try:
            yield from resp.stream(chunk)
        finally:
            resp.close()
            resp.release_conn()

    def exists(self, key: str) -> bool:
        try:
            self.client.stat_object(self.bucket, key)
            return True
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                return False
            raise StorageError(f"cannot stat {key}: {e}") from e
        except _FAILURES as e:
            raise StorageError(f"cannot stat {key}: {e}") from e

    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[ObjectInfo]:
        """Objects under prefix (recursive); raise InvalidInput when the bucket is unknown."""
        out: list[ObjectInfo] = []
        try:
            for obj in self.client.list_objects(bucket, prefix=prefix, recursive=True):
                if obj.is_dir or obj.object_name is None:
                    continue
                out.append(ObjectInfo(obj.object_name, int(obj.size or 0)))
                if len(out) > limit:
                    break
        except S3Error as e:
            if e.code == "NoSuchBucket":
                raise InvalidInput(f"no bucket {bucket!r} in the platform's object store") from e
            raise StorageError(f"cannot list s3://{bucket}/{prefix}: {e}") from e
        except _FAILURES as e:
            raise StorageError(f"cannot list s3://{bucket}/{prefix}: {e}") from e
        return out

    def presign_get(self, key: str, ttl: dt.timedelta, bucket: str | None = None) -> str:
        try:
            return self.presigner.url("GET", bucket or self.bucket, key, ttl)
        except _FAILURES as e:
            raise StorageError(f"cannot presign {key}: {e}") from e

    def presign_put(self, key: str, ttl: dt.timedelta) -> str:
        try:
            return self.presigner.url("PUT", self.bucket, key, ttl)
        except _FAILURES as e:
            raise StorageError(f"cannot presign {key}: {e}") from e

    def delete(self, key: str) -> None:
        try:
            self.client.remove_object(self.bucket, key)
        except _FAILURES as e:
            raise StorageError(f"cannot delete {key}: {e}") from e

    def copy(self, key: str, to: str) -> None:
        try:
            self.client.copy_object(self.bucket, to, CopySource(self.bucket, key))
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                raise InvalidInput(f"no object {key}") from e
            raise StorageError(f"cannot copy {key}: {e}") from e
        except _FAILURES as e:
            raise StorageError(f"cannot copy {key}: {e}") from e

    # --- multipart: the SDK's own calls for these are private API, so here they are plain S3
    # requests, signed by the presigner and sent on the SDK's connection pool ---

    def begin_multipart(self, key: str) -> str:
        try:
            reply = self._call("POST", key, {"uploads": ""},
                               headers={"Content-Type": "application/octet-stream"})
        except S3Refusal as e:
            raise StorageError(f"cannot start an upload of {key}: {e}") from e
        upload_id = _text(reply, "UploadId")
        if not upload_id:
            raise StorageError(f"cannot start an upload of {key}: S3 answered no upload id")
        return upload_id

    def presign_part(self, key: str, upload_id: str, number: int, ttl: dt.timedelta) -> str:
        try:
            return self.presigner.url("PUT", self.bucket, key, ttl,
                                      query={"partNumber": str(number), "uploadId": upload_id})
        except _FAILURES as e:
            raise StorageError(f"cannot presign part {number} of {key}: {e}") from e

    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> None:
        root = ET.Element("CompleteMultipartUpload")
        for n, etag in enumerate(etags, 1):
            part = ET.SubElement(root, "Part")
            ET.SubElement(part, "PartNumber").text = str(n)
            ET.SubElement(part, "ETag").text = '"' + etag.strip('"') + '"'
        body = ET.tostring(root)
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        try:
            self._call("POST", key, {"uploadId": upload_id}, body=body,
                       headers={"Content-Type": "application/xml", "Content-MD5": md5})
        except S3Refusal as e:
            if e.code in NAMED_WRONGLY:
                raise InvalidInput(f"the upload of {key} could not be completed: {e}") from e
            raise StorageError(f"cannot complete the upload of {key}: {e}") from e

    def abort_multipart(self, key: str, upload_id: str) -> None:
        # Best effort: an abandoned upload only costs space until storage cleans it up.
        with contextlib.suppress(S3Refusal, StorageError):
            self._call("DELETE", key, {"uploadId": upload_id})

    def _call(self, method: str, key: str, query: Mapping[str, str], *, body: bytes = b"",
              headers: Mapping[str, str] | None = None) -> ET.Element | None:
        """One S3 request on `key` in the platform's bucket: its XML reply (None when empty).
        S3's error reply (even one sent with 200, as CompleteMultipartUpload may) is S3Refusal;
        a store that cannot be reached is StorageError."""
        data = b""
        try:
            url = self.presigner.url(method, self.bucket, key, CALL_TTL, query=query)
            resp = self._http.request(method, url, body=body, headers=dict(headers or {}),
                                      preload_content=False, redirect=False)
            try:
                data = resp.read(MAX_REPLY + 1)
            finally:
                if len(data) > MAX_REPLY:
                    resp.close()  # the rest is unread: this connection cannot be reused
                else:
                    resp.release_conn()
        except _FAILURES as e:
            raise StorageError(f"object storage unreachable: {e}") from e
        reply = _xml(data[:MAX_REPLY]) if data.strip() else None
        if reply is not None and _local(reply.tag) == "Error":
            raise S3Refusal(resp.status, _text(reply, "Code") or "Unknown", _text(reply, "Message"))
        if resp.status >= 300:
            raise S3Refusal(resp.status, f"HTTP{resp.status}", resp.reason or "no error body")
        return reply

    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) of a stored object, by reading it back."""
        h, size = hashlib.sha256(), 0
        for chunk in self.stream(key):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()


def _xml(data: bytes) -> ET.Element | None:
    # From the platform's own S3 server, bounded; expat expands no external entities.
    try:
        return ET.fromstring(data)  # noqa: S314
    except ET.ParseError:
        return None


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _text(element: ET.Element | None, name: str) -> str:
    """A direct child's text, in whatever XML namespace S3 put it."""
    for child in element if element is not None else ():
        if _local(child.tag) == name:
            return child.text or ""
    return ""


class MemoryObjects:
    """The ObjectStore protocol in memory, for tests of what stores objects without an S3
    server. A presigned URL is `memory://BUCKET/KEY?...`, and `accept` is what a PUT to one
    does (an upload's part answers its ETag, as S3 does). tests/integration/test_objects.py
    holds it to S3Store on the same cases."""

    def __init__(self, bucket: str = "campugrid", buckets: tuple[str, ...] = ()) -> None:
        self.bucket = bucket
        self._objects: dict[tuple[str, str], bytes] = {}
        self._buckets = {bucket, *buckets}
        self._uploads: dict[str, tuple[str, dict[int, bytes]]] = {}  # id -> (key, parts)
        self._lock = threading.Lock()

    def close(self) -> None:
        pass

    def ensure_bucket(self) -> None:
        self._buckets.add(self.bucket)

    def put_bytes(self, key: str, data: bytes, bucket: str | None = None) -> None:
        with self._lock:
            self._objects[(bucket or self.bucket, key)] = bytes(data)

    def put_file(self, key: str, data: BinaryIO, size: int) -> None:
        data.seek(0)
        self.put_bytes(key, data.read(size))

    def _get(self, key: str, bucket: str | None = None) -> bytes:
        with self._lock:
            found = self._objects.get((bucket or self.bucket, key))
        if found is None:
            raise InvalidInput(f"no object {key}")
        return found

    def get_bytes(self, key: str, bucket: str | None = None) -> bytes:
        return self._get(key, bucket)

    def stream(self, key: str, chunk: int = 1024 * 1024) -> Iterator[bytes]:
        data = self._get(key)
        for at in range(0, len(data), chunk):
            yield data[at:at + chunk]

    def exists(self, key: str) -> bool:
        with self._lock:
            return (self.bucket, key) in self._objects

    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[ObjectInfo]:
        if bucket not in self._buckets:
            raise InvalidInput(f"no bucket {bucket!r} in the platform's object store")
        with self._lock:
            found = sorted((k, len(v)) for (b, k), v in self._objects.items()
                           if b == bucket and k.startswith(prefix))
        return [ObjectInfo(k, n) for k, n in found[:limit + 1]]

    def _url(self, method: str, bucket: str, key: str, ttl: dt.timedelta,
             **query: str) -> str:
        params = urllib.parse.urlencode({"method": method, "ttl": int(ttl.total_seconds()),
                                         **query})
        return f"memory://{bucket}/{urllib.parse.quote(key)}?{params}"

    def presign_get(self, key: str, ttl: dt.timedelta, bucket: str | None = None) -> str:
        return self._url("GET", bucket or self.bucket, key, ttl)

    def presign_put(self, key: str, ttl: dt.timedelta) -> str:
        return self._url("PUT", self.bucket, key, ttl)

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop((self.bucket, key), None)

    def copy(self, key: str, to: str) -> None:
        self.put_bytes(to, self._get(key))

    def begin_multipart(self, key: str) -> str:
        upload_id = secrets.token_hex(16)
        with self._lock:
            self._uploads[upload_id] = (key, {})
        return upload_id

    def presign_part(self, key: str, upload_id: str, number: int, ttl: dt.timedelta) -> str:
        return self._url("PUT", self.bucket, key, ttl, partNumber=str(number), uploadId=upload_id)

    def accept(self, url: str, data: bytes) -> str:
        """A PUT of `data` to a presigned URL of this store: the object, or an upload's part
        (its ETag returned, quoted, as S3 answers it)."""
        parts = urllib.parse.urlsplit(url)
        key = urllib.parse.unquote(parts.path.lstrip("/"))
        query = dict(urllib.parse.parse_qsl(parts.query))
        if "uploadId" not in query:
            self.put_bytes(key, data, parts.netloc)
        else:
            with self._lock:
                upload = self._uploads.get(query["uploadId"])
                if upload is None or upload[0] != key:
                    raise InvalidInput(f"NoSuchUpload: no upload {query['uploadId']} of {key}")
                upload[1][int(query["partNumber"])] = bytes(data)
        return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'

    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> None:
        with self._lock:
            upload = self._uploads.get(upload_id)
            if upload is None or upload[0] != key:
                raise InvalidInput(f"the upload of {key} could not be completed: NoSuchUpload")
            parts = upload[1]
            for n, etag in enumerate(etags, 1):
                got = parts.get(n)
                if got is None or hashlib.md5(got, usedforsecurity=False).hexdigest() \
                        != etag.strip('"'):
                    raise InvalidInput(f"the upload of {key} could not be completed: "
                                       f"InvalidPart {n}")
            self._objects[(self.bucket, key)] = b"".join(parts[n] for n in range(1, len(etags) + 1))
            del self._uploads[upload_id]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop(upload_id, None)

    def digest(self, key: str) -> tuple[int, str]:
        data = self._get(key)
        return len(data), hashlib.sha256(data).hexdigest()
