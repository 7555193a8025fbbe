"""Jobs as researchers see them: submit, read, cancel, and what a job left behind.

Every read or change of a job takes `owner`: the app asking, or None for an admin. A job of
another app is NotFound, as one that does not exist."""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from campugrid.buildpolicy.tarballs import inspect_context
from campugrid.coordinator.bases import BaseResolver
from campugrid.coordinator.config import Settings
from campugrid.coordinator.objects import ObjectStore
from campugrid.coordinator.quorum import answer_key
from campugrid.coordinator.services.inputs import InputService
from campugrid.coordinator.store import Store
from campugrid.coordinator.verified import NOT_RESUMED
from campugrid.coordinator.views import CheckpointView, EventView, JobView, LogView, ShardView
from campugrid.coordinator.waiting import offline_text, waiting_reason
from campugrid.coordinator.wakeup import Wakeup
from campugrid.protocol.errors import InvalidInput, NotFound
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState

log = logging.getLogger("campugrid.coordinator")


def answer_of(replica: JobView) -> tuple[int | None, str, str] | None:
    return answer_key(replica.state.value, replica.exit_code, replica.result,
                      replica.output_digest)


class JobService:
    def __init__(self, settings: Settings, store: Store, objects: ObjectStore,
                 inputs: InputService, bases: Callable[[], BaseResolver], work: Wakeup) -> None:
        """`bases`: the resolver of remote FROMs, made at the first submit that needs it."""
        self.settings, self.store, self.objects = settings, store, objects
        self.inputs, self.bases, self.work = inputs, bases, work

    def submit(self, spec: JobSpec, context: BinaryIO, owner: str = "") -> tuple[JobView, bool]:
        """Validate everything, store the context, then the job; answer only after both. The
        context is a seekable file (the upload's spool), never read into memory whole."""
        size = context.seek(0, io.SEEK_END)
        if size > self.settings.max_context_bytes:
            raise InvalidInput(f"context: larger than {self.settings.max_context_bytes // 1024**2} MiB")
        info = inspect_context(context, self.settings.allowed_bases, self.settings.base_registries)
        bases = self.bases().resolve_all(info.checked.bases)  # refused here if one cannot be
        tickets = self.inputs.check(spec, owner)
        if spec.command is None and not info.checked.runs:
            raise InvalidInput("command: the job says nothing to run: give a command in the spec "
                               "(`command`, or `submit --command`), or end the Dockerfile with "
                               "CMD [...] (without either, it would run its base image's "
                               "default, which is often a shell that exits at once)")
        context.seek(0)
        digest = hashlib.file_digest(context, "sha256").hexdigest()  # type: ignore[arg-type]
        key = f"contexts/{digest}.tar"
        if not self.objects.exists(key):
            self.objects.put_file(key, context, size)
        job, created = self.store.submit(spec, key, digest, owner, tickets, bases)
        if created:
            log.info("job submitted", extra={"job_id": job.id})
            self.work.notify()
        return job, created

    def job_id(self, ref: str, owner: str | None = None) -> str:
        """The id of the job `ref` names (its id, or a start of it that is one job's alone)."""
        return self.store.job_id(ref, owner)

    def get(self, job_id: str, owner: str | None = None) -> JobView:
        return self.store.get(job_id, owner)

    def list_jobs(self, state: JobState | None, limit: int,
                  owner: str | None = None) -> list[JobView]:
        return self.store.list_jobs(state, limit, owner)

    def waiting_reasons(self, jobs: Sequence[JobView]) -> list[str | None]:
        """Why each queued job is not running, from the machines online now (read once for
        a whole page: a sweep's jobs are mostly queued)."""
        queued = [j.id for j in jobs if j.state is JobState.QUEUED]
        machines = self.store.machines.online() if queued else []
        pending = self.store.machines.pending_online() if queued else 0
        refused = self.store.refusals(queued)
        offline = offline_text(self.store.machines.all()) if queued and not machines else ""
        return [waiting_reason(j, machines, pending, refused.get(j.id, {}), offline)
                for j in jobs]

    def events(self, job_id: str, owner: str | None = None) -> list[EventView]:
        self.store.get(job_id, owner)
        return self.store.events(job_id)

    def logs(self, job_id: str, *, after_id: int, stream: str | None,
             owner: str | None = None) -> tuple[JobView, list[LogView]]:
        job = self.store.get(job_id, owner)
        return job, self.store.logs(job_id, after_id=after_id, stream=stream)

    def log_tail(self, job_id: str, owner: str | None = None,
                 limit: int = 2000) -> list[LogView]:
        self.store.get(job_id, owner)
        return self.store.log_tail(job_id, limit)

    def shards(self, job_id: str, *, state: str | None, after: int,
               limit: int, owner: str | None = None) -> list[ShardView]:
        self.store.get(job_id, owner)
        return self.store.shards.shards(job_id, state=state, after=after, limit=limit)

    def cancel(self, job_id: str, owner: str | None = None) -> JobView:
        return self.store.cancel(job_id, owner)

    def rerun(self, job_id: str, owner: str | None = None) -> JobView:
        """The same job again, as a new job (a tainted result's remedy)."""
        job = self.store.rerun(job_id, owner)
        self.work.notify()
        return job

    def replicas(self, job: JobView) -> list[tuple[JobView, bool | None]]:
        """A verified job's replicas, each with whether its answer is the one the job took
        (None: no answer, or the job not decided yet)."""
        replicas = self.store.replicas(job.id)
        chosen = next((r for r in replicas if job.state.final and r.machine_id == job.machine_id
                       and answer_of(r) is not None), None)
        taken = answer_of(chosen) if chosen is not None else None
        # With a compare command, one judged alike agreed; one never compared, no one knows.
        judged = self.store.judged(job.id) if job.spec.verify and job.spec.verify.compare else None

        def agreed(r: JobView) -> bool | None:
            if taken is None or chosen is None or answer_of(r) is None:
                return None
            if answer_of(r) == taken or judged is None:
                return answer_of(r) == taken
            return judged.get(frozenset((r.id, chosen.id)))

        return [(r, agreed(r)) for r in replicas]

    def open_output(self, job_id: str, owner: str | None = None) -> tuple[JobView, Iterator[bytes]]:
        """The job and its output archive, streamed from storage; NotFound where it has none
        (or where the archive is gone from storage)."""
        job = self.store.get(job_id, owner)
        if job.output_key is None or not self.objects.exists(job.output_key):
            raise NotFound(f"job {job.id} has no output (state {job.state.value})")
        return job, self.objects.stream(job.output_key)

    def checkpoints(self, job_id: str, owner: str | None = None) -> list[CheckpointView]:
        """The job's checkpoints kept in storage (the last few epochs), oldest first."""
        self.store.get(job_id, owner)
        return self.store.checkpoints.of(job_id)

    def open_checkpoint(self, job_id: str, epoch: int,
                        owner: str | None = None) -> tuple[CheckpointView, Iterator[bytes]]:
        """One of the job's checkpoints, streamed from storage, for its owner to keep."""
        found = [c for c in self.checkpoints(job_id, owner) if c.epoch == epoch]
        # Of several (attempts that saved the epoch again), one a check did not set aside.
        found.sort(key=lambda c: c.verdict not in NOT_RESUMED)
        if not found or not self.objects.exists(found[-1].key):
            raise NotFound(f"job {job_id} has no checkpoint of epoch {epoch} in storage")
        return found[-1], self.objects.stream(found[-1].key)
