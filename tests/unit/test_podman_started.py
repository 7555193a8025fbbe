"""When a container started, from Podman's State (podman_ops.started_at): RFC 3339 with
nanoseconds and whatever offset the host has."""

from __future__ import annotations

import datetime as dt

import pytest

from campugrid.sandbox.podman_ops import started_at

NOON = dt.datetime(2026, 12, 3, 12, 0, 0, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("2026-12-03T12:00:00.250000000Z", NOON + 0.25),
    ("2026-12-03T07:00:00.25-05:00", NOON + 0.25),
    ("2026-12-03T13:00:00+01:00", NOON),
    ("0001-01-01T00:00:00Z", False),  # made, never started
    ("", False),
    ("yesterday", None),
])
def test_started_at(text: str, expected: float | bool | None):
    got = started_at({"StartedAt": text})
    assert got == pytest.approx(expected) if isinstance(expected, float) else got is expected


def test_no_state_is_unknown():
    assert started_at(None) is None
