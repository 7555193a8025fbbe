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


class _Containers:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def get(self, name: str) -> object:
        raise self.error


def _api_ops(error: Exception) -> object:
    """ApiOps on a client that answers every container lookup with `error` (the race below
    cannot be made to happen on demand against a real service)."""
    from types import SimpleNamespace

    from campugrid.sandbox.podman_ops import ApiOps

    ops = object.__new__(ApiOps)
    ops.client = SimpleNamespace(containers=_Containers(error))  # type: ignore[attr-defined]
    return ops


def test_a_container_podman_is_removing_reads_as_gone_and_other_errors_do_not():
    """Podman answers 500 "does not exist in database: no such container" for a --rm
    sandbox caught while it is removed (a dying shard sandbox, in a full run): that is the
    404 case, not an error that fails the task on this machine."""
    from podman.errors import APIError

    racing = APIError("500 Server Error: Internal Server Error", explanation=(
        "container bf0b6548 does not exist in database: no such container"))
    assert _api_ops(racing).state("t-1") is None  # type: ignore[attr-defined]
    _api_ops(racing).kill("t-1", "KILL")  # type: ignore[attr-defined]  # nothing to kill
    with pytest.raises(APIError, match="storage is full"):
        _api_ops(APIError("500 Server Error", explanation="storage is full")).state("t-1")  # type: ignore[attr-defined]


def test_a_podman_whose_service_will_not_start_is_tried_twice_then_the_command_line_saying_why(
        tmp_path, caplog):
    """The agent's Podman questions go through the command line where the API service cannot
    start, and the log says what the service printed (a flake once left no trace of why)."""
    import logging

    from campugrid.sandbox.podman_ops import CliOps, connect

    tries = tmp_path / "tries"
    podman = tmp_path / "podman"
    podman.write_text(f"#!/bin/sh\necho x >> {tries}\necho 'Error: database is locked' >&2\n"
                      "exit 125\n")
    podman.chmod(0o755)
    with caplog.at_level(logging.INFO, logger="campugrid.sandbox.podman_ops"):
        ops = connect(tmp_path / "run", str(podman))
    assert isinstance(ops, CliOps)
    assert tries.read_text().count("x") == 2
    assert "did not start" in caplog.text and "database is locked" in caplog.text
    assert not list((tmp_path / "run" / "campugrid").iterdir())  # socket and log cleaned up
