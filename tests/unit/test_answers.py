"""One table answers a domain error on REST, the console and gRPC (coordinator/answers.py)."""

import grpc

from campugrid.coordinator.answers import OTHERWISE, TABLE, answer, http_headers
from campugrid.protocol.errors import (
    BuildFailed,
    Conflict,
    IllegalTransition,
    InvalidInput,
    RateLimited,
    StorageError,
)


def test_no_row_is_shadowed_by_an_earlier_one():
    kinds = [kind for kind, _ in TABLE]
    for i, later in enumerate(kinds):
        assert not [k for k in kinds[:i] if issubclass(later, k)], later


def test_each_error_is_answered_alike_on_every_transport():
    assert (answer(InvalidInput("x")).http, answer(InvalidInput("x")).grpc) == (
        422, grpc.StatusCode.INVALID_ARGUMENT)
    assert answer(Conflict("x")).http == 409 == answer(IllegalTransition("x")).http
    assert answer(StorageError("x")).http == 503
    assert answer(StorageError("x")).grpc is grpc.StatusCode.UNAVAILABLE  # agents try again
    assert answer(BuildFailed("x")) == OTHERWISE
    assert http_headers(RateLimited("slow down", 7)) == {"retry-after": "7"}
    assert http_headers(InvalidInput("x")) is None
