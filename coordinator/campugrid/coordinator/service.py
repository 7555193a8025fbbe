"""What the coordinator does, independent of the transport: REST and gRPC both call this."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import io
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from campugrid.builders.policy.tarballs import inspect_context
from campugrid.coordinator.apps import AppView
from campugrid.coordinator.bases import BaseResolver
from campugrid.coordinator.config import Settings
from campugrid.coordinator.gpu_history import GpuMemory
from campugrid.coordinator.holds import Holds
from campugrid.coordinator.images import Images
from campugrid.coordinator.machines import MachineRecord, MachineRecords
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.objects import ObjectStore
from campugrid.coordinator.registry import RegistryTokens
from campugrid.coordinator.scheduler import MachineView, fast_from
from campugrid.coordinator.store import Store
from campugrid.coordinator.uploads import UploadView
from campugrid.coordinator.users import SecretBox, Users
from campugrid.coordinator.views import (
    CheckpointUpload,
    CheckpointView,
    Claim,
    DatasetFile,
    EventView,
    HoldRef,
    JobView,
    Lease,
    LogView,
    ShardResult,
    ShardTask,
    ShardView,
    utcnow,
)
from campugrid.coordinator.waiting import offline_text, waiting_reason
from campugrid.coordinator.wakeup import Wakeup
from campugrid.protocol.errors import Conflict, Forbidden, InvalidInput, NotFound, StorageError
from campugrid.protocol.spec import MAX_SHARD_RESULT, DatasetRef, JobSpec
from campugrid.protocol.states import JobState

log = logging.getLogger("campugrid.coordinator")
SPEEDS_REFRESH_S = 10.0  # how old the machines' speed ranking may be


MAX_OUTPUT_FILES = 200  # files of an output listed on its job (the rest: in the archive)
MAX_OUTPUT_PATH = 256  # characters of each listed path

class Coordinator:
    def __init__(self, settings: Settings, store: Store, objects: ObjectStore) -> None:
        self.settings = settings
        self.store = store
        self.objects = objects
        self._offers: dict[str, object] = {}
        self._offers_lock = threading.Lock()
        self._speeds: dict[str, float] = {}
        self._fast_from = 0.0  # the speed from which a machine counts as fast
        self._speeds_at = -SPEEDS_REFRESH_S
        self._context_urls: dict[str, tuple[str, float]] = {}  # key -> (URL, good until)
        self._machines = MachineRecords(store.machines)
        self.holds = Holds(store)
        self.work = Wakeup(settings.held_leases)  # held Lease calls, woken by new work

    @functools.cached_property
    def images(self) -> Images:
        """Shared images: who builds, who pulls, and the registry tokens for it."""
        registry = (RegistryTokens(self.settings.registry_dir, self.settings.registry,
                                   self.settings.registry_token_seconds)
                    if self.settings.registry else None)
        return Images(self.store.db, registry)

    @functools.cached_property
    def bases(self) -> BaseResolver:
        """Remote FROMs to digests, at submit."""
        return BaseResolver(self.settings.registry_mirrors,
                            RegistryTokens(self.settings.registry_dir, self.settings.registry,
                                           self.settings.registry_token_seconds))

    @functools.cached_property
    def users(self) -> Users:
        """The console's people; their TOTP secrets are sealed with console.key, a file in
        the state folder (never in the database)."""
        return Users(self.store.db, SecretBox.at(self.settings.state_dir / "console.key"),
                     self.store.limiter)

    def submit(self, spec: JobSpec, context: BinaryIO, owner: str = "") -> tuple[JobView, bool]:
        """Validate everything, store the context, then the job; answer only after both. The
        context is a seekable file (the upload's spool), never read into memory whole."""
        size = context.seek(0, io.SEEK_END)
        if size > self.settings.max_context_bytes:
            raise InvalidInput(f"context: larger than {self.settings.max_context_bytes // 1024**2} MiB")
        info = inspect_context(context, self.settings.allowed_bases, self.settings.base_registries)
        bases = self.bases.resolve_all(info.checked.bases)  # refused here if one cannot be
        tickets = []
        for ds in spec.datasets:
            if ds.ticket:
                self._check_upload(ds, owner, spec.client_job_id)
                tickets.append(ds.ticket)
                continue
            if ds.share:  # on a provider's machine: its agent checks each file by sha256
                continue
            if ds.bucket in (self.settings.s3_bucket, "campugrid-ready-probe"):
                raise InvalidInput(f"dataset {ds.name}: bucket {ds.bucket!r} holds the platform's "
                                   "own data (other jobs' contexts, outputs and checkpoints)")
            if not ds.pinned():
                raise InvalidInput(
                    f"dataset {ds.name}: name its content, not only where it is: give the "
                    "object's sha256 (for a prefix: \"sha256\": {path: sha256} of the files the "
                    "job reads), or upload the file with a ticket (`submit --upload`)")
            self._dataset_files(ds)  # refuses unknown buckets and missing files now
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

    # Every read or change of a job takes `owner`: the app asking, or None for an admin. A job
    # of another app is NotFound, as one that does not exist.

    def job_id(self, ref: str, owner: str | None = None) -> str:
        """The id of the job `ref` names (its id, or a start of it that is one job's alone)."""
        return self.store.job_id(ref, owner)

    def get_job(self, job_id: str, owner: str | None = None) -> JobView:
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

    def job_events(self, job_id: str, owner: str | None = None) -> list[EventView]:
        self.store.get(job_id, owner)
        return self.store.events(job_id)

    def job_logs(self, job_id: str, *, after_id: int, stream: str | None,
                 owner: str | None = None) -> tuple[JobView, list[LogView]]:
        job = self.store.get(job_id, owner)
        return job, self.store.logs(job_id, after_id=after_id, stream=stream)

    def job_log_tail(self, job_id: str, owner: str | None = None,
                     limit: int = 2000) -> list[LogView]:
        self.store.get(job_id, owner)
        return self.store.log_tail(job_id, limit)

    def shards(self, job_id: str, *, state: str | None, after: int,
               limit: int, owner: str | None = None) -> list[ShardView]:
        self.store.get(job_id, owner)
        return self.store.shards.shards(job_id, state=state, after=after, limit=limit)

    def cancel(self, job_id: str, owner: str | None = None) -> JobView:
        return self.store.cancel(job_id, owner)

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
        return self.store.checkpoints(job_id)

    def open_checkpoint(self, job_id: str, epoch: int,
                        owner: str | None = None) -> tuple[CheckpointView, Iterator[bytes]]:
        """One of the job's checkpoints, streamed from storage, for its owner to keep."""
        found = [c for c in self.checkpoints(job_id, owner) if c.epoch == epoch]
        if not found or not self.objects.exists(found[-1].key):
            raise NotFound(f"job {job_id} has no checkpoint of epoch {epoch} in storage")
        return found[-1], self.objects.stream(found[-1].key)

    def machine_names(self) -> dict[str, str]:
        """Every machine's name by its id (for pages that would otherwise show ids)."""
        return {m.id: m.name for m in self.store.machines.all()}

    # --- apps ---------------------------------------------------------------------------------

    def apps(self) -> list[AppView]:
        return self.store.apps.all()

    def invite_app(self, name: str, by: AppView, *, admin: bool = False) -> tuple[str, dt.datetime]:
        """A one-time code for a new app; only its digest is kept."""
        code, expires = self.store.apps.invite(name, by.id, admin=admin)
        log.info("invite for app %r made by %s (until %s)", name, by.name, f"{expires:%Y-%m-%d %H:%M}")
        return code, expires

    def redeem_invite(self, code: str, public_key: str) -> AppView:
        app = self.store.apps.redeem(code, public_key)
        log.info("app %r joined with key %s", app.name, app.fingerprint)
        return app

    def revoke_app(self, name: str, by: AppView) -> AppView:
        if name == by.name:
            raise Conflict("an admin cannot revoke its own key (another admin can)")
        app = self.store.apps.revoke(name)
        log.warning("app %r (%s) revoked by %s", app.name, app.fingerprint, by.name)
        return app

    # --- machines -----------------------------------------------------------------------------

    def register_machine(self, name: str, public_key: str, address: str = "") -> MachineRecord:
        """A machine for this key: new ones are pending until their owner approves them."""
        if not name or len(name) > 200:
            raise InvalidInput("name: 1 to 200 characters")
        record = self.store.machines.register(name, public_key, address)
        if record.status is MachineStatus.REVOKED:
            raise Forbidden(f"the key of machine {record.id} was revoked by its owner; join "
                            "with a new key (a new state folder) if that was a mistake")
        log.info("machine %s (%s) registered from %s: %s, fingerprint %s", record.id, name,
                 address or "?", record.status.value, record.fingerprint)
        return record

    def machine(self, machine_id: str) -> MachineRecord:
        """The machine a call claims to be (its key and status; see MachineRecords)."""
        return self._machines.get(machine_id)

    def shared(self) -> dict[str, dict[tuple[str, int, str], int]]:
        return self.store.machines.shared()

    def machines(self) -> list[MachineRecord]:
        return self.store.machines.all()

    def online_machines(self) -> list[MachineView]:
        """Approved machines heard from lately, with their GPUs and the job each one runs."""
        return self.store.machines.online()

    def approve_machine(self, ref: str) -> MachineRecord:
        m = self.store.machines.set_status(self.store.machines.find(ref).id,
                                           MachineStatus.APPROVED)
        self._machines.forget(m.id)
        log.info("machine %s (%s, %s) approved", m.id, m.name, m.fingerprint)
        return m

    def revoke_machine(self, ref: str) -> tuple[MachineRecord, list[str]]:
        """Revoke now: its leases end and its jobs go back to the queue at once."""
        m = self.store.machines.set_status(self.store.machines.find(ref).id,
                                           MachineStatus.REVOKED)
        self._machines.forget(m.id)
        requeued = self.requeue_expired()
        log.warning("machine %s (%s) revoked; its jobs %s are queued again", m.id, m.name,
                    ", ".join(requeued) or "(none)")
        return m, requeued

    def lease(self, machine_id: str, offer: MachineView | None = None) -> Lease | None:
        if offer is not None:
            self._note_offer(machine_id, offer)
        claim = self.store.claim(machine_id, self.settings.lease_seconds, offer,
                                 heavy_first=self.is_fast(machine_id))
        if claim is None:
            return None
        job, hold = claim.job, self.holds.of(claim.hold(machine_id))
        try:
            lease = self._lease_for(claim, machine_id)
            if lease.datasets:
                self.store.note(job.id, job.attempt, "inputs", _how_inputs_move(job, lease))
            return lease
        except InvalidInput as e:  # e.g. a dataset was deleted since submit: it cannot run
            hold.finish(succeeded=False, reason=f"cannot start: {e}")
            return None
        except StorageError:  # storage is down: not the job's fault, hand it straight back
            hold.release("object storage unavailable", failed=False)
            raise

    def is_fast(self, machine_id: str) -> bool:
        """Is this machine among the faster half online (by its matmul score)? The ranking is
        at most SPEEDS_REFRESH_S old; a machine not in it yet counts as slow until then."""
        now = time.monotonic()
        if now - self._speeds_at > SPEEDS_REFRESH_S:
            speeds = {m.id: m.speed for m in self.store.machines.online()}
            self._fast_from = fast_from(list(speeds.values()))
            self._speeds, self._speeds_at = speeds, now
        speed = self._speeds.get(machine_id, 0.0)
        return speed >= self._fast_from

    # --- what machines hold (holds.py: one set of verbs for every kind of hold) -----------

    def next_shard(self, ref: HoldRef, done: ShardResult | None) -> ShardTask | None:
        """Record the shard the session finished (if any) and hand out its next one."""
        if done is not None and done.result_json is not None:
            _check_result(done.index, done.result_json)
        return self.holds.of(ref).next_shard(done, heavy_first=self.is_fast(ref.machine_id))

    def renew(self, ref: HoldRef, phase: JobState) -> float:
        """Extend the lease of a hold (an attempt moves to `phase`); returns the lease
        granted, in seconds."""
        self.holds.of(ref).renew(phase, self.settings.lease_seconds)
        return self.settings.lease_seconds

    def report_logs(self, ref: HoldRef, stream: str, seq: int, text: str) -> None:
        if stream not in ("build", "run"):
            raise InvalidInput("stream: build or run")
        self.holds.of(ref).log(stream, seq, text)

    def complete(self, ref: HoldRef, *, succeeded: bool, exit_code: int | None,
                 reason: str | None, result: str | None, output_uploaded: bool,
                 limits: dict[str, str], output_files: Sequence[tuple[str, int]] = ()) -> None:
        """The end of a hold as its machine reports it. `output_files`: what the agent says
        the output holds (kept bounded, shown as said)."""
        key = self.output_key(ref.job_id, ref.token) if output_uploaded else None
        if key is not None and not self.objects.exists(key):
            key = None  # claimed but not there: never point researchers at nothing
        self.holds.of(ref).finish(
            succeeded=succeeded, exit_code=exit_code, reason=reason, result=result,
            output_key=key, limits=limits,
            output_files=[(_printable(p)[:MAX_OUTPUT_PATH], max(0, int(n)))
                          for p, n in output_files[:MAX_OUTPUT_FILES]])
        log.info("%s %d of job %s ended (%s)", ref.kind.value, ref.token, ref.job_id,
                 "succeeded" if succeeded else "failed", extra={"job_id": ref.job_id})

    def release(self, ref: HoldRef, reason: str, *, failed: bool,
                cannot_run_here: bool = False) -> None:
        """Hand a hold back: a drain, (`failed`) a provider-side failure, which counts
        against the job's attempts or the shard's tries, or (`cannot_run_here`) a machine
        that cannot run the job, which is not offered it again for a while."""
        self.holds.of(ref).release(reason[:2000] or "drained", failed=failed,
                                   cannot_run_here=cannot_run_here)
        self.work.notify()

    def requeue_expired(self) -> list[str]:
        """The jobs whose lease (or a shard session's) ran out: queued again, or failed."""
        requeued = self.store.requeue_expired()
        if requeued:
            self.work.notify()
        return requeued

    def extend_active_leases(self) -> int:
        """After a restart, give agents one lease period to reach us again."""
        return self.store.extend_active_leases(self.settings.lease_seconds)

    def close(self) -> None:
        self.objects.close()
        self.store.close()

    def _note_offer(self, machine_id: str, offer: MachineView) -> None:
        """Keep the machine's GPU snapshot (for why-it-waits) fresh: written when it changes,
        not once per poll (the agent's heartbeat, every 10 s, writes it too)."""
        if self._remember_offer(machine_id, offer):
            self.store.machines.heartbeat(machine_id, offer=offer)

    def heartbeat(self, machine_id: str, capabilities: dict[str, Any] | None,
                  offer: MachineView | None) -> None:
        self.store.machines.heartbeat(machine_id, capabilities, offer)
        if offer is not None:
            self._remember_offer(machine_id, offer)

    def note_memory(self, machine_id: str, gpus: Sequence[GpuMemory]) -> None:
        """For the console's memory chart: an approved machine's GPUs, as it reports them."""
        self.store.gpu_history.note(machine_id, gpus)

    def _remember_offer(self, machine_id: str, offer: MachineView) -> bool:
        """Note what is stored now; False if it was stored already."""
        key = (offer.gpus, offer.gpu_isolation)
        with self._offers_lock:
            if self._offers.get(machine_id) == key:
                return False
            self._offers[machine_id] = key
            return True

    def _lease_for(self, claim: Claim, machine_id: str) -> Lease:
        job, resume = claim.job, claim.resume
        ttl = dt.timedelta(seconds=self.settings.presign_seconds)
        # Shards report results, not output folders: their sessions get no upload URL.
        output_url = ("" if claim.session is not None
                      else self.objects.presign_put(self.output_key(job.id, job.attempt), ttl))
        return Lease(
            job=job,
            lease_seconds=self.settings.lease_seconds,
            context_url=self._context_url(job.context_key),
            output_url=output_url,
            datasets={
                ds.name: [DatasetFile(path, self.objects.presign_get(key, ttl, bucket) if key else "",
                                      size, sha)
                          for path, key, size, sha, bucket in self._dataset_files(ds)]
                for ds in job.spec.datasets
            },
            resume=resume,
            resume_url=self.objects.presign_get(resume.key, ttl) if resume else "",
            gpu_uuids=list(claim.gpu_uuids),
            hold=claim.hold(machine_id),
            shard=claim.shard,
            shares={ds.name: ds.share for ds in job.spec.datasets if ds.share},
        )

    def _context_url(self, key: str) -> str:
        """Contexts are shared by digest (a sweep's jobs all have one): a presigned GET is
        reused while at least half of its validity is left."""
        now = time.monotonic()
        hit = self._context_urls.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        url = self.objects.presign_get(key, dt.timedelta(seconds=self.settings.presign_seconds))
        if len(self._context_urls) > 10_000:
            self._context_urls.clear()
        self._context_urls[key] = (url, now + self.settings.presign_seconds / 2)
        return url

    def begin_checkpoint(self, ref: HoldRef, epoch: int, size: int) -> CheckpointUpload:
        hold = self.holds.of(ref)
        hold.checkpoint_allowed()
        hold.check(f"checkpoint of epoch {epoch}")
        if not 0 < size <= self.settings.max_checkpoint_bytes or epoch < 0:
            raise InvalidInput(f"checkpoint of epoch {epoch}: size {size} is out of bounds "
                               f"(at most {self.settings.max_checkpoint_bytes} bytes)")
        key = _checkpoint_key(ref, epoch)
        part = self.settings.checkpoint_part_bytes
        upload_id = self.objects.begin_multipart(key)
        ttl = dt.timedelta(seconds=self.settings.presign_seconds)
        urls = [self.objects.presign_part(key, upload_id, n, ttl)
                for n in range(1, (size + part - 1) // part + 1)]
        return CheckpointUpload(key, upload_id, part, urls)

    def record_checkpoint(self, ref: HoldRef, *, epoch: int, key: str, upload_id: str,
                          etags: list[str], size: int, sha256: str) -> None:
        """Complete the upload, check what arrived, and only then record it."""
        hold = self.holds.of(ref)
        hold.checkpoint_allowed()
        if key != _checkpoint_key(ref, epoch):
            raise InvalidInput(f"checkpoint key {key!r} does not belong to this attempt")
        hold.check(f"checkpoint of epoch {epoch}")
        try:
            self.objects.complete_multipart(key, upload_id, etags)
        except InvalidInput:
            self.objects.abort_multipart(key, upload_id)
            raise
        got_size, got_sha = self.objects.digest(key)
        if (got_size, got_sha) != (size, sha256):
            self.objects.delete(key)
            raise InvalidInput(f"checkpoint of epoch {epoch} arrived damaged: {got_size} bytes, "
                               f"sha256 {got_sha[:12]}…, expected {size} bytes, {sha256[:12]}…")
        for old in hold.checkpoint(epoch=epoch, key=key, size=size, sha256=sha256,
                                   keep=self.settings.keep_checkpoints):
            self.objects.delete(old)

    @staticmethod
    def output_key(job_id: str, attempt: int) -> str:
        return f"outputs/{job_id}/attempt-{attempt}.tar.gz"

    def _check_upload(self, ds: DatasetRef, owner: str, client_job_id: str | None) -> None:
        """The ticket is the owner's, unused (or used by this very submission, retried),
        unexpired, and its object is the file it names: size and sha256 read back."""
        up = self.store.uploads.get(ds.ticket, owner)
        if up.job_id is not None:
            used_by = self.store.get(up.job_id)
            if client_job_id is None or used_by.client_job_id != client_job_id:
                raise InvalidInput(f"dataset {ds.name}: upload ticket {ds.ticket[:40]!r} was "
                                   f"used by job {up.job_id} already; a ticket is for one job")
            return
        if up.expires_at < utcnow():
            raise InvalidInput(f"dataset {ds.name}: upload ticket {ds.ticket[:40]!r} expired at "
                               f"{up.expires_at:%H:%M:%S} UTC; upload the file again")
        if not self.objects.exists(up.key):
            raise InvalidInput(f"dataset {ds.name}: nothing was uploaded with ticket "
                               f"{ds.ticket[:40]!r} (PUT the file to its url first)")
        size, sha256 = self.objects.digest(up.key)
        if (size, sha256) != (up.size, up.sha256):
            raise InvalidInput(
                f"dataset {ds.name}: the uploaded file is not the one ticket {ds.ticket[:40]!r} "
                f"is for ({size} bytes, sha256 {sha256[:12]}…; the ticket names {up.size} bytes, "
                f"sha256 {up.sha256[:12]}…)")

    def create_upload(self, owner: str, filename: str, size: int,
                      sha256: str) -> tuple[UploadView, str]:
        """An upload ticket and the presigned URL to PUT its file to."""
        up = self.store.uploads.create(owner, filename, size, sha256,
                                       max_bytes=self.settings.max_upload_bytes,
                                       ttl_s=self.settings.upload_ttl_s)
        url = self.objects.presign_put(up.key, dt.timedelta(seconds=self.settings.upload_ttl_s))
        return up, url

    def sweep_uploads(self) -> int:
        """Delete the uploads whose job has ended, and those whose ticket expired unused."""
        gone = 0
        for up in self.store.uploads.ended():
            try:
                self.objects.delete(up.key)
            except StorageError:
                log.warning("upload %s could not be deleted yet", up.ticket)
                continue
            self.store.uploads.forget(up.ticket)
            gone += 1
        return gone

    def _dataset_files(self, ds: DatasetRef) -> list[tuple[str, str, int, str, str | None]]:
        """(path under /data/<name>, key, size, sha256, bucket) for each file of a dataset
        reference; the sha256 is what the agent checks the file against before the job."""
        if ds.ticket:
            up = self.store.uploads.get(ds.ticket)
            return [(up.filename, up.key, up.size, up.sha256, None)]
        if ds.share:  # no URL: the machine that shares it has the files
            assert isinstance(ds.sha256, tuple)
            return [(path, "", 0, sha, None) for path, sha in ds.sha256]
        limit = self.settings.max_dataset_files
        found = self.objects.list_objects(ds.bucket, ds.key, limit)
        if len(found) > limit:
            raise InvalidInput(f"dataset {ds.name}: more than {limit} objects under {ds.uri}")
        if not ds.is_prefix:  # one object: /data/<name>/<its file name>
            exact = [o for o in found if o.key == ds.key]
            if not exact:
                raise InvalidInput(f"dataset {ds.name}: nothing found at {ds.uri}")
            sha = ds.sha256 if isinstance(ds.sha256, str) else ""
            return [(ds.key.rsplit("/", 1)[-1], ds.key, exact[0].size, sha, ds.bucket)]
        sizes = {o.key[len(ds.key):]: o.size for o in found}
        if isinstance(ds.sha256, tuple):  # the files the job named, each by its digest
            missing = [path for path, _ in ds.sha256 if path not in sizes]
            if missing:
                raise InvalidInput(f"dataset {ds.name}: {', '.join(missing[:5])} not found "
                                   f"under {ds.uri}")
            return [(path, ds.key + path, sizes[path], sha, ds.bucket) for path, sha in ds.sha256]
        files: list[tuple[str, str, int, str, str | None]] = [
            (path, ds.key + path, size, "", ds.bucket) for path, size in sizes.items()]
        if not files:  # a spec stored before contents were pinned: what is there, unchecked
            raise InvalidInput(f"dataset {ds.name}: nothing found at {ds.uri}")
        for path, *_ in files:
            if ".." in path.split("/") or path.startswith("/"):
                raise InvalidInput(f"dataset {ds.name}: object name {path!r} is not a safe path")
        return files


def _how_inputs_move(job: JobView, lease: Lease) -> str:
    """Per input of the job's record: how it reaches the machine, and how many bytes."""
    parts = []
    for ds in job.spec.datasets:
        files = lease.datasets.get(ds.name, [])
        size = sum(f.size for f in files)
        plural = "s" if len(files) != 1 else ""
        if ds.share:
            parts.append(f"{ds.name}: {len(files)} file{plural} from the machine's share "
                         f"{ds.share!r} (linked in place, or copied), checked by sha256")
            continue
        how = "by upload ticket" if ds.ticket else "from S3"
        parts.append(f"{ds.name}: {len(files)} file{plural} {how}, "
                     f"{size} bytes" + (", checked by sha256" if all(f.sha256 for f in files)
                                        else ", not pinned"))
    return "; ".join(parts)


def _checkpoint_key(ref: HoldRef, epoch: int) -> str:
    return f"checkpoints/{ref.job_id}/epoch-{epoch:08d}-attempt-{ref.token}.tar"


def _printable(text: str) -> str:
    """What an agent said, as pages and terminals may show it: no control characters."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _check_result(index: int, result_json: str) -> None:
    if len(result_json) > MAX_SHARD_RESULT:
        raise InvalidInput(f"result of shard {index}: larger than {MAX_SHARD_RESULT} bytes")
    try:
        json.loads(result_json)
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"result of shard {index}: not JSON") from e
