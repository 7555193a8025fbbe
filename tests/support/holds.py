"""Holds as tests name them (coordinator/holds.py): a plain job's attempt, a shard session."""

from campugrid.coordinator.views import HoldKind, HoldRef


def attempt(job_id: str, token: int, machine_id: str) -> HoldRef:
    return HoldRef(job_id, HoldKind.ATTEMPT, token, machine_id)


def session(job_id: str, token: int, machine_id: str) -> HoldRef:
    return HoldRef(job_id, HoldKind.SESSION, token, machine_id)
