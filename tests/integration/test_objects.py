"""S3Store against a real S3 server (SeaweedFS, started for the session), and the in-memory
MemoryObjects held to it on the same cases."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import secrets
import socket

import httpx
import pytest

from campugrid.cli.seaweed import EmbeddedS3
from campugrid.coordinator.objects import MemoryObjects, S3Store
from campugrid.protocol.errors import InvalidInput, StorageError

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


def test_keys_of_any_spelling_round_trip_through_presigned_urls(s3: S3Store):
    for key in ("out/a b+c=d.bin", "out/ü日本/データ~1.csv", "out/semi;colon@at!$'()*,.txt"):
        assert s3.presigner.handles(s3.bucket, key)  # signed by us, not the SDK
        assert httpx.put(s3.presign_put(key, TTL), content=key.encode()).status_code == 200
        assert httpx.get(s3.presign_get(key, TTL)).content == key.encode()
        assert s3.get_bytes(key) == key.encode()


def test_the_region_is_settled_once_and_a_configured_one_is_signed(s3: S3Store,
                                                                   s3_server: EmbeddedS3):
    assert s3.region == "us-east-1"  # asked of SeaweedFS (GetBucketLocation) at ensure_bucket
    other = S3Store(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, s3.bucket,
                    region="eu-central-1", addressing="path")
    assert other.region == "eu-central-1"
    other.put_bytes("r.bin", b"region")
    url = other.presign_get("r.bin", TTL)
    assert "%2Feu-central-1%2Fs3%2F" in url
    assert httpx.get(url).content == b"region"
    other.close()


def test_a_multipart_upload_through_presigned_parts(s3: S3Store):
    key = "checkpoints/j/epoch-00000001-attempt-1.tar"
    upload = s3.begin_multipart(key)
    parts = [secrets.token_bytes(5 * 1024 * 1024), b"the tail"]
    etags = []
    for n, part in enumerate(parts, 1):
        r = httpx.put(s3.presign_part(key, upload, n, TTL), content=part, timeout=60)
        assert r.status_code == 200, r.text
        etags.append(r.headers["ETag"])
    s3.complete_multipart(key, upload, etags)
    assert s3.get_bytes(key) == b"".join(parts)
    assert s3.digest(key) == (len(b"".join(parts)), hashlib.sha256(b"".join(parts)).hexdigest())

    dropped = s3.begin_multipart("checkpoints/j/dropped.tar")
    assert dropped != upload
    r = httpx.put(s3.presign_part("checkpoints/j/dropped.tar", dropped, 1, TTL), content=b"x")
    assert r.status_code == 200
    s3.abort_multipart("checkpoints/j/dropped.tar", dropped)
    s3.abort_multipart("checkpoints/j/dropped.tar", dropped)  # best effort: twice is fine
    with pytest.raises(InvalidInput, match="NoSuchUpload"):
        s3.complete_multipart("checkpoints/j/dropped.tar", dropped, [r.headers["ETag"]])
    assert not s3.exists("checkpoints/j/dropped.tar")


def test_s3_errors_carry_s3s_code(s3: S3Store, s3_server: EmbeddedS3):
    # An upload the agent names wrongly is its mistake (InvalidInput), with S3's own words.
    with pytest.raises(InvalidInput, match="NoSuchUpload: The specified multipart upload"):
        s3.complete_multipart("ckpt/x.tar", "no-such-upload-id", ['"abc"'])
    # The store refusing us is a StorageError, with S3's code and message.
    wrong = S3Store(s3_server.endpoint, s3_server.access_key, "not-the-secret", s3.bucket,
                    region="us-east-1")
    with pytest.raises(StorageError, match="SignatureDoesNotMatch: The request signature"):
        wrong.begin_multipart("ckpt/y.tar")
    with pytest.raises(StorageError, match="SignatureDoesNotMatch"):
        wrong.complete_multipart("ckpt/y.tar", "no-such-upload-id", ['"abc"'])
    wrong.abort_multipart("ckpt/y.tar", "no-such-upload-id")  # best effort: no error
    wrong.close()


def test_an_unreachable_store_is_a_storage_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gone = S3Store(f"127.0.0.1:{port}", "k", "s", "bucket", region="us-east-1")
    gone._http.connection_pool_kw["retries"] = 0  # no backoff in a test
    with pytest.raises(StorageError, match="unreachable"):
        gone.begin_multipart("k")
    nowhere = S3Store(f"127.0.0.1:{port}", "k", "s", "bucket")  # its region must be asked
    nowhere._http.connection_pool_kw["retries"] = 0
    with pytest.raises(StorageError, match="unreachable"):
        nowhere.ensure_bucket()


# --- the same cases through S3Store and the in-memory MemoryObjects ---------------------------


@pytest.fixture(params=["s3", "memory"])
def store(request: pytest.FixtureRequest) -> S3Store | MemoryObjects:
    if request.param == "memory":
        return MemoryObjects()
    return request.getfixturevalue("s3")


def put_to(store: S3Store | MemoryObjects, url: str, data: bytes) -> str:
    """A PUT to a presigned URL, as an agent sends it; the part's ETag."""
    if isinstance(store, MemoryObjects):
        return store.accept(url, data)
    r = httpx.put(url, content=data, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["ETag"]


def test_both_stores_keep_read_list_and_forget_objects_alike(store):
    key = "contexts/ä b+c.tar"
    assert not store.exists(key)
    store.put_bytes(key, b"\x00payload")
    assert store.exists(key) and b"".join(store.stream(key, chunk=3)) == b"\x00payload"
    assert store.digest(key) == (8, hashlib.sha256(b"\x00payload").hexdigest())
    store.put_file("f.bin", io.BytesIO(b"0123456789"), 4)  # `size` bytes from the start
    assert store.digest("f.bin") == (4, hashlib.sha256(b"0123").hexdigest())
    for name in ("ds/x.csv", "ds/sub/y.csv", "other/z"):
        store.put_bytes(name, name.encode())
    listed = store.list_objects(store.bucket, "ds/", 10)
    assert sorted((o.key, o.size) for o in listed) == [("ds/sub/y.csv", 12), ("ds/x.csv", 8)]
    assert len(store.list_objects(store.bucket, "ds/", 1)) == 2  # one past the limit: more
    with pytest.raises(InvalidInput, match="no bucket"):
        store.list_objects("no-such-bucket-" + secrets.token_hex(4), "", 10)
    store.copy(key, "outputs/kept.tar.gz")  # the store's own copy: a later PUT cannot touch it
    store.put_bytes(key, b"changed")
    assert b"".join(store.stream("outputs/kept.tar.gz")) == b"\x00payload"
    with pytest.raises(InvalidInput, match="no object"):
        store.copy("no/such/key", "outputs/x")
    store.delete(key)
    store.delete(key)  # twice is fine
    assert not store.exists(key)


def test_both_stores_take_a_multipart_upload_alike(store):
    key = "checkpoints/j/epoch-00000002-attempt-1.tar"
    upload = store.begin_multipart(key)
    parts = [secrets.token_bytes(5 * 1024 * 1024), b"the tail"]
    etags = [put_to(store, store.presign_part(key, upload, n, TTL), part)
             for n, part in enumerate(parts, 1)]
    assert not store.exists(key)  # nothing until it is completed
    store.complete_multipart(key, upload, etags)
    assert store.digest(key) == (len(b"".join(parts)), hashlib.sha256(b"".join(parts)).hexdigest())
    again = store.begin_multipart(key + ".2")
    put_to(store, store.presign_part(key + ".2", again, 1, TTL), b"x")
    with pytest.raises(InvalidInput):  # a part it never got
        store.complete_multipart(key + ".2", again, ['"' + "0" * 32 + '"'])
    store.abort_multipart(key + ".2", again)
    with pytest.raises(InvalidInput):  # an upload that is gone
        store.complete_multipart(key + ".2", again, ['"' + "0" * 32 + '"'])
    assert not store.exists(key + ".2")
