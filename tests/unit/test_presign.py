"""Our presigned URLs are exactly the minio SDK's (a contract test: same inputs, same URL) on
local and AWS-style endpoints, both addressing styles and any key; the platform's integration
and acceptance tests use them against a real S3 server."""

from __future__ import annotations

import datetime as dt
import random
import socket
import types
from pathlib import Path

import minio.time
import pytest
from minio import Minio

from campugrid.coordinator import presign
from campugrid.coordinator.config import Settings
from campugrid.coordinator.objects import S3Store
from campugrid.coordinator.presign import Presigner, signed_region

AK, SK = "AKID", "s3cr3t/+="
HOUR = dt.timedelta(hours=1)
WHEN = [dt.datetime(2026, 11, 29, 17, 5, 9, tzinfo=dt.UTC),
        dt.datetime(2027, 1, 1, 0, 0, 0, tzinfo=dt.UTC),
        dt.datetime(2026, 6, 30, 23, 59, 59, tzinfo=dt.timezone(dt.timedelta(hours=-7)))]
KEYS = ["outputs/3f2a9c1e-0000-4000-8000-000000000001/attempt-1.tar.gz",
        "contexts/" + "ab" * 32 + ".tar", "a", "data/train_01.part-7~x",
        "with space", "a+b=c", "a//b", "/leading", "trailing/", "ü", "日本/データ.csv",
        "emoji 😀", "per%cent%7E", "q?x=1&y#frag", "semi;colon,comma:colon@at!$'()*",
        "tab\tand\nnewline", "..hidden", "dir/...", "~tilde", "x" * 900]


def random_keys(n: int) -> list[str]:
    """Keys from an alphabet of what quoting treats differently (seeded: the same every run)."""
    rnd = random.Random(13)
    alphabet = "aZ09-_.~/ +=%&?#:;@!$'()*,[]{}|\\^`\"<>\x01\x7fé日😀\u200b"
    keys = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 40))) for _ in range(n)]
    return [k for k in keys if k.strip() and not {".", ".."} & set(k.split("/"))]


# (endpoint, https, region given to both, addressing): what users point the platform at.
ENDPOINTS = [
    ("127.0.0.1:8333", False, "us-east-1", "auto"),  # a local server: path style
    ("127.0.0.1:8333", False, "eu-west-3", "auto"),  # a non-AWS server with its own region
    ("storage.example.org:443", True, "us-east-1", "auto"),  # the SDK drops a default port
    ("127.0.0.1:80", False, "us-east-1", "auto"),
    ("minio.example.org:9000", True, "us-east-1", "virtual"),  # virtual-host forced
    ("s3.amazonaws.com", True, "us-east-1", "auto"),
    ("s3.amazonaws.com", True, "eu-west-1", "auto"),  # the global host, a bucket elsewhere
    ("s3.eu-central-1.amazonaws.com", True, "eu-central-1", "auto"),
    ("s3.eu-central-1.amazonaws.com", True, "", "auto"),  # the host names the region
    ("s3.eu-central-1.amazonaws.com", True, "eu-central-1", "path"),  # path forced on AWS
    ("s3.us-east-1.amazonaws.com", False, "us-east-1", "auto"),
    ("s3.dualstack.us-west-2.amazonaws.com", True, "", "auto"),
    ("s3-accelerate.amazonaws.com", True, "us-east-1", "auto"),
    ("s3-accelerate.dualstack.amazonaws.com", True, "us-east-1", "path"),
    ("s3-external-1.amazonaws.com", True, "", "auto"),
    ("s3.cn-north-1.amazonaws.com.cn", True, "", "auto"),
    ("oss-cn-hangzhou.aliyuncs.com", True, "cn-hangzhou", "auto"),  # the SDK's other virtual host
]
BUCKETS = ["campugrid", "my.dotted.bucket", "data-2026"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """A region is always given or named by the host: nothing here may ask a server."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a unit test tried to reach the network: {args}")
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def sdk(endpoint: str, secure: bool, region: str, addressing: str, secret: str = SK) -> Minio:
    """The SDK configured by its public API alone: the side of the contract we must equal."""
    client = Minio(endpoint, AK, secret, secure=secure, region=region or None)
    if addressing == "path":
        client.disable_virtual_style_endpoint()
    elif addressing == "virtual":
        client.enable_virtual_style_endpoint()
    return client


def store(endpoint: str, secure: bool, region: str, addressing: str) -> S3Store:
    return S3Store(endpoint, AK, SK, "campugrid", secure=secure, region=region, addressing=addressing)


def outcome(sign: object) -> str:
    """The URL, or the kind of refusal (so that both sides must refuse alike)."""
    try:
        return str(sign() if callable(sign) else sign)
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize(("endpoint", "secure", "region", "addressing"), ENDPOINTS)
def test_the_same_url_as_the_sdk(endpoint, secure, region, addressing, bucket):
    expected_sdk = sdk(endpoint, secure, region, addressing)
    ours = store(endpoint, secure, region, addressing).presigner
    if "accelerate" in endpoint and "." in bucket:  # the SDK refuses these, and so do we
        assert outcome(lambda: ours.handles(bucket, "k")).startswith("ValueError")
    else:  # the contract is about our own signing, not about handing everything to the SDK
        assert all(ours.handles(bucket, key) for key in KEYS + random_keys(60))
    wrong = []
    for key in KEYS + random_keys(60):
        for method in ("GET", "PUT"):
            for when in WHEN:
                expected = outcome(lambda: expected_sdk.get_presigned_url(
                    method, bucket, key, expires=HOUR, request_date=when))
                got = outcome(lambda: ours.url(method, bucket, key, HOUR, now=when))
                if got != expected:
                    wrong.append((method, key, when, got, expected))
    assert not wrong, wrong[:3]


@pytest.mark.parametrize(("endpoint", "secure", "region", "addressing"), ENDPOINTS)
@pytest.mark.parametrize("query", [{"uploads": ""}, {"partNumber": "7", "uploadId": "abc/+==~x"},
                                   {"uploadId": "2~_ü x", "partNumber": "10000"}])
def test_multipart_urls_are_the_sdks_too(endpoint, secure, region, addressing, query):
    expected_sdk = sdk(endpoint, secure, region, addressing)
    ours = store(endpoint, secure, region, addressing).presigner
    for method in ("POST", "PUT", "DELETE"):
        for key in ("checkpoints/j/epoch-00000001-attempt-1.tar", "with space+ü"):
            expected = expected_sdk.get_presigned_url(method, "campugrid", key, expires=HOUR,
                                                      request_date=WHEN[0],
                                                      extra_query_params=dict(query))
            assert ours.url(method, "campugrid", key, HOUR, query=query, now=WHEN[0]) == expected


@pytest.mark.parametrize(("endpoint", "secure", "region", "addressing"), ENDPOINTS[:9])
def test_presigned_get_and_put_object_too(monkeypatch, endpoint, secure, region, addressing):
    """S3Store's own presign_get / presign_put against the SDK's named calls (its PUT takes no
    date: the SDK's clock is fixed for it)."""
    monkeypatch.setattr(minio.time, "utcnow", lambda: WHEN[0])
    expected_sdk = sdk(endpoint, secure, region, addressing)
    s3 = store(endpoint, secure, region, addressing)
    monkeypatch.setattr(presign, "dt", types.SimpleNamespace(datetime=_Frozen, UTC=dt.UTC,
                                                             timedelta=dt.timedelta))
    for key in ("outputs/j/attempt-1.tar.gz", "datasets/a b/ü+=.csv"):
        assert s3.presign_get(key, HOUR) == expected_sdk.presigned_get_object(
            "campugrid", key, HOUR, request_date=WHEN[0])
        assert s3.presign_put(key, HOUR) == expected_sdk.presigned_put_object("campugrid", key, HOUR)
        assert s3.presign_get(key, HOUR, bucket="data-2026") == expected_sdk.presigned_get_object(
            "data-2026", key, HOUR, request_date=WHEN[0])


class _Frozen(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return WHEN[0].astimezone(tz)


@pytest.mark.parametrize(("endpoint", "secure", "region", "addressing", "bucket", "starts"), [
    ("127.0.0.1:8333", False, "us-east-1", "auto", "campugrid", "http://127.0.0.1:8333/campugrid/k?"),
    ("127.0.0.1:8333", False, "us-east-1", "virtual", "campugrid", "http://campugrid.127.0.0.1:8333/k?"),
    ("s3.amazonaws.com", True, "eu-west-1", "auto", "campugrid",
     "https://campugrid.s3.eu-west-1.amazonaws.com/k?"),
    ("s3.eu-central-1.amazonaws.com", True, "", "auto", "campugrid",
     "https://campugrid.s3.eu-central-1.amazonaws.com/k?"),
    ("s3.eu-central-1.amazonaws.com", True, "", "path", "campugrid",
     "https://s3.eu-central-1.amazonaws.com/campugrid/k?"),
    # A dotted bucket over https would not match the certificate as a host name: path style.
    ("s3.eu-central-1.amazonaws.com", True, "", "auto", "my.dotted.bucket",
     "https://s3.eu-central-1.amazonaws.com/my.dotted.bucket/k?"),
    ("s3.eu-central-1.amazonaws.com", False, "", "auto", "my.dotted.bucket",
     "http://my.dotted.bucket.s3.eu-central-1.amazonaws.com/k?"),
    ("s3-accelerate.amazonaws.com", True, "us-east-1", "auto", "campugrid",
     "https://campugrid.s3-accelerate.amazonaws.com/k?"),
])
def test_the_addressing_the_sdk_picks_and_the_fast_path_signs_it(endpoint, secure, region,
                                                                 addressing, bucket, starts):
    ours = store(endpoint, secure, region, addressing).presigner
    assert ours.handles(bucket, "k")  # the common cases never take the SDK's slow path
    url = ours.url("GET", bucket, "k", HOUR, now=WHEN[0])
    assert url.startswith(starts), url
    assert url == sdk(endpoint, secure, region, addressing).get_presigned_url(
        "GET", bucket, "k", expires=HOUR, request_date=WHEN[0])


def test_the_region_comes_from_the_setting_or_the_aws_host_without_a_request():
    assert store("s3.eu-central-1.amazonaws.com", True, "", "auto").region == "eu-central-1"
    assert store("s3.dualstack.ap-south-1.amazonaws.com", True, "", "auto").region == "ap-south-1"
    assert store("s3.amazonaws.com", True, "eu-west-1", "auto").region == "eu-west-1"
    assert store("127.0.0.1:8333", False, "eu-west-3", "auto").region == "eu-west-3"
    url = store("127.0.0.1:8333", False, "eu-west-3", "auto").presign_get("k", HOUR)
    assert signed_region(url) == "eu-west-3"


def test_bad_settings_are_refused_at_once(monkeypatch, tmp_path: Path):
    with pytest.raises(ValueError, match="addressing"):
        S3Store("127.0.0.1:8333", AK, SK, "campugrid", addressing="sideways")
    with pytest.raises(ValueError, match="region"):
        S3Store("127.0.0.1:8333", AK, SK, "campugrid", region="no region!")
    monkeypatch.setenv("CAMPUGRID_S3_ADDRESSING", "sideways")
    with pytest.raises(ValueError, match="CAMPUGRID_S3_ADDRESSING='sideways'"):
        Settings.from_env(tmp_path)
    monkeypatch.setenv("CAMPUGRID_S3_ADDRESSING", "Path")
    monkeypatch.setenv("CAMPUGRID_S3_REGION", "eu-central-1")
    settings = Settings.from_env(tmp_path)
    assert (settings.s3_addressing, settings.s3_region) == ("path", "eu-central-1")
    monkeypatch.delenv("CAMPUGRID_S3_ADDRESSING")
    monkeypatch.delenv("CAMPUGRID_S3_REGION")
    assert (Settings.from_env(tmp_path).s3_addressing, Settings.from_env(tmp_path).s3_region) == (
        "auto", "")


def test_a_different_secret_or_day_signs_differently():
    a = Presigner(sdk("h:1", False, "us-east-1", "auto", "one"), AK, "one")
    b = Presigner(sdk("h:1", False, "us-east-1", "auto", "two"), AK, "two")
    assert a.handles("bkt", "k") and b.handles("bkt", "k")
    assert a.url("GET", "bkt", "k", HOUR, now=WHEN[0]) != b.url("GET", "bkt", "k", HOUR, now=WHEN[0])
    assert a.url("GET", "bkt", "k", HOUR, now=WHEN[0]) != a.url("GET", "bkt", "k", HOUR, now=WHEN[1])


def test_a_url_we_cannot_reproduce_is_left_to_the_sdk():
    """Checked once per bucket against the SDK's own URL: here the secrets differ."""
    ours = Presigner(sdk("127.0.0.1:8333", False, "us-east-1", "auto", "the SDK's"), AK, SK)
    assert not ours.handles("campugrid", "k")
    assert ours.url("GET", "campugrid", "k", HOUR, now=WHEN[0]) == sdk(
        "127.0.0.1:8333", False, "us-east-1", "auto", "the SDK's").get_presigned_url(
        "GET", "campugrid", "k", expires=HOUR, request_date=WHEN[0])


def test_what_the_sdk_refuses_is_refused_in_its_words():
    ours = Presigner(sdk("127.0.0.1:8333", False, "us-east-1", "auto"), AK, SK)
    for key in ("a/./b", "../up", " ", "", "\ud800"):
        assert not ours.handles("campugrid", key)
    for bucket in ("no", "Upper_Case_Bucket_Name_That_Is_Far_Too_Long_" * 2, "1.2.3.4"):
        with pytest.raises(ValueError):
            ours.url("GET", bucket, "k", HOUR)
    for expires in (dt.timedelta(0), dt.timedelta(days=8)):
        with pytest.raises(ValueError, match="expires"):
            ours.url("GET", "campugrid", "k", expires)
