"""One root error type, with a subtree per boundary. Each error says what the user can do."""

from __future__ import annotations


class CampugridError(Exception):
    """Root of every error campugrid raises on purpose."""


class InvalidInput(CampugridError):
    """Something a user sent (spec, tarball, Dockerfile, dataset reference) was refused."""


class NotFound(CampugridError):
    pass


class Conflict(CampugridError):
    """The request contradicts what is stored (e.g. same client job id, different spec)."""


class StaleAttempt(CampugridError):
    """A call about an attempt that is no longer the job's current one (fencing)."""


class IllegalTransition(CampugridError):
    """The job is not in a state from which this change is allowed."""


class Unauthenticated(CampugridError):
    pass


class BuildFailed(CampugridError):
    def __init__(self, reason: str, log_tail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_tail = log_tail

    def __str__(self) -> str:
        return f"{self.reason}\n{self.log_tail}" if self.log_tail else self.reason


class SandboxError(CampugridError):
    """The sandbox could not be set up or run (not: the job's own command failed)."""


class StorageError(CampugridError):
    """Object storage could not be reached or refused an operation."""
