"""S3Store against a real S3 server (SeaweedFS, started for the session)."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from campugrid.coordinator.objects import S3Store
from campugrid.protocol.errors import InvalidInput

pytestmark = pytest.mark.integration
TTL = dt.timedelta(minutes=5)


def test_put_get_exists_delete(s3: S3Store):
    assert not s3.exists("a/b.bin")
    s3.put_bytes("a/b.bin", b"\x00payload")
    assert s3.exists("a/b.bin")
    assert s3.get_bytes("a/b.bin") == b"\x00payload"
    assert b"".join(s3.stream("a/b.bin", chunk=3)) == b"\x00payload"
    s3.delete("a/b.bin")
    assert not s3.exists("a/b.bin")
    with pytest.raises(InvalidInput, match="no object"):
        s3.get_bytes("a/b.bin")


def test_listing_is_recursive_and_bounded(s3: S3Store):
    for name in ("ds/x.csv", "ds/sub/y.csv", "other/z"):
        s3.put_bytes(name, name.encode())
    found = s3.list_objects(s3.bucket, "ds/", limit=10)
    assert sorted((o.key, o.size) for o in found) == [("ds/sub/y.csv", 12), ("ds/x.csv", 8)]
    assert len(s3.list_objects(s3.bucket, "", limit=1)) == 2  # limit + 1 tells "too many"
    with pytest.raises(InvalidInput, match="no bucket"):
        s3.list_objects("no-such-bucket-here", "", limit=10)


def test_presigned_urls_work_without_credentials_and_refuse_tampering(s3: S3Store):
    put = s3.presign_put("out/result.tgz", TTL)
    assert httpx.put(put, content=b"result").status_code == 200
    get = s3.presign_get("out/result.tgz", TTL)
    assert httpx.get(get).content == b"result"
    tampered = get.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(tampered).status_code == 403
    other_key = get.replace("out/result.tgz", "out/other.tgz")
    assert httpx.get(other_key).status_code == 403
