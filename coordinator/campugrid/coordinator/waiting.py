"""Why a queued job waits, in words its owner can act on: placement's reasons (scheduler.
why_waiting) over the machines online, less those that said they cannot run it, with other
apps' jobs unnamed; or, with none online, when an approved one was last heard from."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from campugrid.coordinator.machines import MachineRecord
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.scheduler import OTHER_APPS, MachineView, why_waiting
from campugrid.coordinator.views import JobView, utcnow
from campugrid.protocol.states import JobState


def offline_text(known: Sequence[MachineRecord]) -> str:
    """With no machine online: the approved ones that are not, and when one was last heard."""
    approved = [m for m in known if m.status is MachineStatus.APPROVED]
    if not approved:
        return ""
    last = max(approved, key=lambda m: m.last_seen_at)
    ago = max(0, int((utcnow() - last.last_seen_at).total_seconds()))
    when = f"{ago // 3600} h" if ago >= 3600 else f"{ago // 60} min" if ago >= 60 else f"{ago} s"
    return (f"no approved machine online ({len(approved)} approved, all offline; "
            f"{last.name} was last heard from {when} ago)")


def waiting_reason(job: JobView, machines: list[MachineView], pending: int = 0,
                    refused: dict[str, str] | None = None, offline: str = "") -> str | None:
    """Why a queued job waits: the machines online, less those that said they cannot run it."""
    if job.state is not JobState.QUEUED:
        return None
    refused = refused or {}
    # Another app's job is not named to this one (its id is not confirmed to strangers).
    able = [m if not m.busy or m.busy_owner == job.owner_id else
            dataclasses.replace(m, busy=OTHER_APPS) for m in machines if m.id not in refused]
    if not machines and offline:
        why = offline
    elif machines and not able:
        said = [f"{m.name}: {refused[m.id]}" for m in machines][:2]
        why = ("every online machine said it cannot run this job (" + "; ".join(said)
               + ("; …" if len(machines) > 2 else "") + ")")
    else:
        why = why_waiting(job.spec.resources, able, job.spec.share)
    if why is not None and pending:
        why += (f"; {pending} machine(s) online wait for their owner's approval "
                "(`campugrid machines`)")
    running = job.shards_total - job.shards_waiting - job.shards_done
    if job.shards_total and running:
        return f"{job.shards_waiting} shards wait, {running} running: {why}"
    return why
