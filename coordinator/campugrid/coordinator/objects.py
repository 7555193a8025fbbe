"""Object storage through the S3 API (minio SDK): build contexts, outputs, datasets.

Agents never hold S3 credentials: the coordinator hands them short-lived presigned URLs for
exactly the objects one task needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import io
from collections.abc import Iterator
from typing import BinaryIO, Protocol

from minio import Minio
from minio.datatypes import Part
from minio.error import MinioException, S3Error
from urllib3.exceptions import HTTPError

from campugrid.coordinator.presign import Presigner
from campugrid.protocol.errors import InvalidInput, StorageError

_FAILURES = (MinioException, HTTPError, OSError, ValueError)
PART_BYTES = 5 * 1024**2  # a streamed upload goes in parts of this size (S3's least)


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
    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str,
                 *, secure: bool = False, region: str = "us-east-1") -> None:
        self.bucket = bucket
        self.client = Minio(endpoint, access_key, secret_key, secure=secure, region=region)
        self.presigner = Presigner(f"{'https' if secure else 'http'}://{endpoint}", access_key,
                                   secret_key, region)

    def close(self) -> None:
        self.client._http.clear()  # the SDK has no close(); its urllib3 pool does

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
        if self.presigner.handles(bucket or self.bucket, key):
            return self.presigner.url("GET", bucket or self.bucket, key, int(ttl.total_seconds()))
        try:
            return str(self.client.presigned_get_object(bucket or self.bucket, key, expires=ttl))
        except _FAILURES as e:
            raise StorageError(f"cannot presign {key}: {e}") from e

    def presign_put(self, key: str, ttl: dt.timedelta) -> str:
        if self.presigner.handles(self.bucket, key):
            return self.presigner.url("PUT", self.bucket, key, int(ttl.total_seconds()))
        try:
            return str(self.client.presigned_put_object(self.bucket, key, expires=ttl))
        except _FAILURES as e:
            raise StorageError(f"cannot presign {key}: {e}") from e

    def delete(self, key: str) -> None:
        try:
            self.client.remove_object(self.bucket, key)
        except _FAILURES as e:
            raise StorageError(f"cannot delete {key}: {e}") from e

    # --- multipart through presigned URLs (the SDK's own multipart calls are private API) --

    def begin_multipart(self, key: str) -> str:
        try:
            return str(self.client._create_multipart_upload(self.bucket, key, {}))
        except _FAILURES as e:
            raise StorageError(f"cannot start an upload of {key}: {e}") from e

    def presign_part(self, key: str, upload_id: str, number: int, ttl: dt.timedelta) -> str:
        try:
            return str(self.client.get_presigned_url(
                "PUT", self.bucket, key, expires=ttl,
                extra_query_params={"partNumber": str(number), "uploadId": upload_id}))
        except _FAILURES as e:
            raise StorageError(f"cannot presign part {number} of {key}: {e}") from e

    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> None:
        parts = [Part(n, etag.strip('"')) for n, etag in enumerate(etags, 1)]
        try:
            self.client._complete_multipart_upload(self.bucket, key, upload_id, parts)
        except _FAILURES as e:
            raise InvalidInput(f"the upload of {key} could not be completed: {e}") from e

    def abort_multipart(self, key: str, upload_id: str) -> None:
        # Best effort: an abandoned upload only costs space until storage cleans it up.
        with contextlib.suppress(*_FAILURES):
            self.client._abort_multipart_upload(self.bucket, key, upload_id)

    def digest(self, key: str) -> tuple[int, str]:
        """(size, sha256) of a stored object, by reading it back."""
        h, size = hashlib.sha256(), 0
        for chunk in self.stream(key):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()
