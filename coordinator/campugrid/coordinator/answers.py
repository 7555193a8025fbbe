"""How the coordinator answers a domain error (protocol/errors.py), on each of its transports:
one table for REST, the console and gRPC, so an error means the same everywhere.

The first row whose type the error is an instance of answers it; a domain error no row names
is a request the coordinator could not carry out (400 on HTTP, UNAVAILABLE on gRPC: an agent
tries again). gRPC's stale-attempt and illegal-transition answers are in-band, not statuses
(agent_service's module docstring says why), so they are answered there before this table.
"""

from __future__ import annotations

import dataclasses

import grpc

from campugrid.protocol.errors import (
    CampugridError,
    Conflict,
    Forbidden,
    IllegalTransition,
    InvalidInput,
    NotFound,
    RateLimited,
    StaleAttempt,
    StorageError,
    Unauthenticated,
)


@dataclasses.dataclass(frozen=True)
class Answer:
    http: int
    grpc: grpc.StatusCode


TABLE: tuple[tuple[type[CampugridError], Answer], ...] = (
    (InvalidInput, Answer(422, grpc.StatusCode.INVALID_ARGUMENT)),
    (NotFound, Answer(404, grpc.StatusCode.NOT_FOUND)),
    (Conflict, Answer(409, grpc.StatusCode.FAILED_PRECONDITION)),
    (StaleAttempt, Answer(409, grpc.StatusCode.FAILED_PRECONDITION)),
    (IllegalTransition, Answer(409, grpc.StatusCode.FAILED_PRECONDITION)),
    (Unauthenticated, Answer(401, grpc.StatusCode.UNAUTHENTICATED)),
    (Forbidden, Answer(403, grpc.StatusCode.PERMISSION_DENIED)),
    (RateLimited, Answer(429, grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (StorageError, Answer(503, grpc.StatusCode.UNAVAILABLE)),
)
OTHERWISE = Answer(400, grpc.StatusCode.UNAVAILABLE)


def answer(error: CampugridError) -> Answer:
    return next((a for kind, a in TABLE if isinstance(error, kind)), OTHERWISE)


def http_headers(error: CampugridError) -> dict[str, str] | None:
    """What an HTTP answer carries besides its status: when to retry a rate-limited call."""
    return {"retry-after": str(error.retry_after_s)} if isinstance(error, RateLimited) else None
