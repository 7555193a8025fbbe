"""Our presigned URLs are exactly the minio SDK's (a contract test: same inputs, same URL);
the platform's integration and acceptance tests use them against a real S3 server."""

from __future__ import annotations

import datetime as dt

import pytest
from minio import Minio

from campugrid.coordinator.presign import Presigner

WHEN = [dt.datetime(2026, 11, 29, 17, 5, 9, tzinfo=dt.UTC),
        dt.datetime(2027, 1, 1, 0, 0, 0, tzinfo=dt.UTC)]
KEYS = ["outputs/3f2a9c1e-0000-4000-8000-000000000001/attempt-1.tar.gz",
        "contexts/" + "ab" * 32 + ".tar", "a", "data/train_01.part-7~x"]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_the_same_url_as_the_sdk(when, key, method):
    sdk = Minio("127.0.0.1:8333", "AKID", "s3cr3t/+=", secure=False, region="us-east-1")
    ours = Presigner("http://127.0.0.1:8333", "AKID", "s3cr3t/+=", "us-east-1")
    assert ours.handles("campugrid", key)
    expected = sdk.get_presigned_url(method, "campugrid", key, expires=dt.timedelta(hours=1),
                                     request_date=when)
    assert ours.url(method, "campugrid", key, 3600, now=when) == expected


def test_a_different_secret_or_day_signs_differently():
    a = Presigner("http://h:1", "AKID", "one", "us-east-1")
    b = Presigner("http://h:1", "AKID", "two", "us-east-1")
    assert a.url("GET", "b", "k", 60, WHEN[0]) != b.url("GET", "b", "k", 60, WHEN[0])
    assert a.url("GET", "b", "k", 60, WHEN[0]) != a.url("GET", "b", "k", 60, WHEN[1])


def test_unusual_keys_are_left_to_the_sdk():
    assert not Presigner.handles("campugrid", "with space")
    assert not Presigner.handles("campugrid", "a//b")
    assert not Presigner.handles("campugrid", "ü")
