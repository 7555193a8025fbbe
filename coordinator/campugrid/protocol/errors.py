"""One root error type, with a subtree per boundary. Each error says what the user can do.

    CampugridError
    ├── InputError          what a user sent was refused
    │   ├── InvalidInput        (spec, tarball, Dockerfile, dataset reference, form field)
    │   ├── NotFound
    │   └── Conflict
    ├── AuthError           who is calling was not established, or may not do this
    │   ├── Unauthenticated     (no signature, unknown or revoked key, replay, tampering)
    │   ├── Forbidden           (known, but not allowed: a pending machine, a non-admin)
    │   └── RateLimited         (too many requests; retry after `retry_after_s`)
    ├── StateError          the call does not fit the job's state (the state machine refused it)
    │   ├── StaleAttempt        (fencing: not the current attempt)
    │   └── IllegalTransition
    ├── SandboxError        the sandbox could not be set up or run
    ├── BuildFailed         the image did not build (the job's own fault)
    └── StorageError        object storage could not be reached or refused
"""

from __future__ import annotations


class CampugridError(Exception):
    """Root of every error campugrid raises on purpose."""


class InputError(CampugridError):
    """Something a user sent was refused; resending it unchanged fails the same way."""


class InvalidInput(InputError):
    """Something a user sent (spec, tarball, Dockerfile, dataset reference) was refused."""


class NotFound(InputError):
    pass


class Conflict(InputError):
    """The request contradicts what is stored (e.g. same client job id, different spec)."""


class AuthError(CampugridError):
    """The caller could not be identified, or may not do this."""


class Unauthenticated(AuthError):
    pass


class Forbidden(AuthError):
    """The caller is known but may not do this (yet): say what would allow it."""


class RateLimited(AuthError):
    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class StateError(CampugridError):
    """The job's state (or its current attempt) does not allow this call now."""


class StaleAttempt(StateError):
    """A call about an attempt that is no longer the job's current one (fencing)."""


class IllegalTransition(StateError):
    """The job is not in a state from which this change is allowed."""


class BuildFailed(CampugridError):
    def __init__(self, reason: str, log_tail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_tail = log_tail

    def __str__(self) -> str:
        return f"{self.reason}\n{self.log_tail}" if self.log_tail else self.reason


class CannotRunHere(CampugridError):
    """This machine cannot run this job, through no fault of the job's: a base image it does
    not have or cannot pull, too little build disk. The agent hands the task back without
    using an attempt, and the coordinator does not lease the job to this machine again
    for an hour (claims.REFUSAL_TTL_S)."""


class SandboxError(CampugridError):
    """The sandbox could not be set up or run (not: the job's own command failed). Carries
    the failing tool's exit code and the tail of its stderr where there was one."""

    def __init__(self, reason: str, exit_code: int | None = None, stderr_tail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail

    def __str__(self) -> str:
        return f"{self.reason}\n{self.stderr_tail}" if self.stderr_tail else self.reason


class StorageError(CampugridError):
    """Object storage could not be reached or refused an operation."""
