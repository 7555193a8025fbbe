"""What machines hold: a lease hands out a hold (holds.py), and every later call about it
goes through the hold's verbs; what may queue work again (a hand-back, an expiry) tells the
dispatchers (wakeup.py)."""

from __future__ import annotations

import bisect
import datetime as dt
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Sequence

from campugrid.coordinator.config import Settings
from campugrid.coordinator.holds import Holds
from campugrid.coordinator.objects import ObjectStore
from campugrid.coordinator.quorum import checkpoint_digest, read_output
from campugrid.coordinator.scheduler import MachineView, fast_from
from campugrid.coordinator.services.inputs import InputService
from campugrid.coordinator.services.machines import MachineService
from campugrid.coordinator.store import Store
from campugrid.coordinator.verified import draw
from campugrid.coordinator.views import (
    CheckpointUpload,
    Claim,
    DatasetFile,
    HoldRef,
    JobView,
    Lease,
    ShardResult,
    ShardTask,
)
from campugrid.coordinator.wakeup import Wakeup
from campugrid.protocol.errors import InvalidInput, StorageError
from campugrid.protocol.spec import MAX_SHARD_RESULT
from campugrid.protocol.states import JobState

log = logging.getLogger("campugrid.coordinator")
SPEEDS_REFRESH_S = 10.0  # how old the machines' speed ranking may be
MAX_OUTPUT_FILES = 200  # files of an output listed on its job (the rest: in the archive)
MAX_OUTPUT_PATH = 256  # characters of each listed path
MAX_LABEL = 200  # characters of the name a job's own code gave a checkpoint


class LeaseService:
    def __init__(self, settings: Settings, store: Store, objects: ObjectStore,
                 machines: MachineService, inputs: InputService, work: Wakeup) -> None:
        self.settings, self.store, self.objects = settings, store, objects
        self.machines, self.inputs, self.work = machines, inputs, work
        self.holds = Holds(store)
        self._speeds: dict[str, float] = {}  # machine -> its score
        self._ranked: list[float] = []  # the same scores, sorted
        self._fast_from = 0.0  # fast_from(_ranked): made with the ranking, not by every claim
        self._speeds_at: float | None = None  # when the ranking was made (None: not yet)
        self._ranking = threading.Lock()  # held while one is being made
        self._context_urls: dict[str, tuple[str, float]] = {}  # key -> (URL, good until)

    # --- asking for work -----------------------------------------------------------------

    def lease(self, machine_id: str, offer: MachineView | None = None) -> Lease | None:
        if offer is not None:
            self.machines.note_offer(machine_id, offer)
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

    def timed_lease(self, machine_id: str,
                    offer: MachineView | None = None) -> tuple[Lease | None, float]:
        """A lease, if any, and how long finding it took (the lease latency)."""
        began = time.perf_counter()
        lease = self.lease(machine_id, offer)
        return lease, time.perf_counter() - began

    def is_fast(self, machine_id: str) -> bool:
        """Is this machine among the faster half online (by its matmul score)? Every claim
        asks. The ranking is made once as the process first needs it (or `rank_speeds`, at
        its start), then made again on a thread of its own once it is SPEEDS_REFRESH_S old,
        the claims going on with the one they have meanwhile: it reads every machine online
        (0.15 s at 3,000 machines, about 0.3 s at 10,000, inside the claim that found it old, and so
        in a dispatch: bench/fleet.py's slowest). A machine that came since is read alone
        and ranked among the others."""
        if self._speeds_at is None:
            self.rank_speeds()
        elif (time.monotonic() - self._speeds_at > SPEEDS_REFRESH_S
              and self._ranking.acquire(blocking=False)):
            threading.Thread(target=self._rank_and_release, name="speeds", daemon=True).start()
        speed = self._speeds.get(machine_id)
        if speed is None:
            speed = self.store.machines.speeds(only=machine_id).get(machine_id, 0.0)
            self._speeds[machine_id] = speed
            bisect.insort(self._ranked, speed)
            self._fast_from = fast_from(self._ranked)
        return speed >= self._fast_from

    def rank_speeds(self) -> None:
        """The first ranking, unless one was made (a start calls it beside the rest)."""
        with self._ranking:
            if self._speeds_at is None:
                self._rank()

    def _rank(self) -> None:
        speeds = self.store.machines.speeds()
        ranked = sorted(speeds.values())
        self._speeds, self._ranked, self._fast_from = speeds, ranked, fast_from(ranked)
        self._speeds_at = time.monotonic()

    def _rank_and_release(self) -> None:
        try:
            self._rank()
        except Exception:  # the database away for a moment: a claim 5 s later tries again
            log.exception("ranking the machines' speeds")
            self._speeds_at = time.monotonic() - SPEEDS_REFRESH_S / 2
        finally:
            self._ranking.release()

    # --- what machines hold (holds.py: one set of verbs for every kind of hold) -----------

    def next_shard(self, ref: HoldRef, done: ShardResult | None) -> ShardTask | None:
        """Record the shard the session finished (if any) and hand out its next one."""
        if done is not None and done.result_json is not None:
            _check_result(done.index, done.result_json)
        task = self.holds.of(ref).next_shard(done, heavy_first=self.is_fast(ref.machine_id))
        if done is not None:  # a verified shard's result may have quarantined a machine
            self.machines.recheck()
        return task

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
        hold = self.holds.of(ref)
        key = (self.output_key(ref.job_id, ref.token)
               if output_uploaded and hold.takes_output else None)
        # A session's end (shards) is neither; an attempt's may be a replica's, a check's...
        replica, decides = self.store.part_of(ref.job_id) if hold.takes_output else (False, False)
        digest = None
        if replica:
            hold.check("complete")  # a stale call costs no reading
            if key is not None:
                key, digest, output_files = self._keep_output(key)
        if key is not None and not self.objects.exists(key):
            key = None  # claimed but not there: never point researchers at nothing
        hold.finish(
            succeeded=succeeded, exit_code=exit_code, reason=reason, result=result,
            output_key=key, limits=limits, output_digest=digest,
            output_files=[(_printable(p)[:MAX_OUTPUT_PATH], max(0, int(n)))
                          for p, n in output_files[:MAX_OUTPUT_FILES]])
        if decides:
            # Something may have been decided: a liar quarantined, more replicas, checks or
            # comparisons queued.
            self.machines.recheck()
            self.work.notify()
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

    def begin_checkpoint(self, ref: HoldRef, epoch: int, size: int) -> CheckpointUpload:
        hold = self.holds.of(ref)
        hold.checkpoint_allowed()
        hold.check(f"checkpoint of epoch {epoch}")
        if not 0 < size <= self.settings.max_checkpoint_bytes or epoch < 0:
            raise InvalidInput(f"checkpoint of epoch {epoch}: size {size} is out of bounds "
                               f"(at most {self.settings.max_checkpoint_bytes} bytes)")
        # A key of its own per upload: what was recorded (and compared) is never overwritten.
        key = f"{_checkpoint_key(ref, epoch)}{secrets.token_hex(8)}.tar"
        part = self.settings.checkpoint_part_bytes
        upload_id = self.objects.begin_multipart(key)
        ttl = dt.timedelta(seconds=self.settings.presign_seconds)
        urls = [self.objects.presign_part(key, upload_id, n, ttl)
                for n in range(1, (size + part - 1) // part + 1)]
        return CheckpointUpload(key, upload_id, part, urls)

    def record_checkpoint(self, ref: HoldRef, *, epoch: int, key: str, upload_id: str,
                          etags: list[str], size: int, sha256: str, label: str = "") -> None:
        """Complete the upload, check what arrived, and only then record it. `label`: how
        the job's own code named it (shown only, as printable text: the machine says it)."""
        label = "".join(ch for ch in label[:4 * MAX_LABEL] if ch.isprintable())[:MAX_LABEL]
        hold = self.holds.of(ref)
        hold.checkpoint_allowed()
        prefix = _checkpoint_key(ref, epoch)
        if not (key.startswith(prefix) and re.fullmatch(r"[0-9a-f]{16}\.tar", key[len(prefix):])):
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
        # Sampled now (the machine cannot know in advance), then read here, where checks
        # compare it (checks.py): never what the machine says it holds.
        chance = self.store.checkpoints.probability(ref.job_id, ref.machine_id)
        digest = (checkpoint_digest(self.objects.stream(key), limit=size)
                  if chance > 0 and draw() < chance else None)
        for old in hold.checkpoint(epoch=epoch, key=key, size=size, sha256=sha256,
                                   keep=self.settings.keep_checkpoints, content_digest=digest,
                                   label=label):
            self.objects.delete(old)
        if digest is not None:  # a check queued, or a checkpoint decided (a liar quarantined)
            self.machines.recheck()
            self.work.notify()

    # --- leases that end without their machine -------------------------------------------

    def requeue_expired(self) -> list[str]:
        """The jobs whose lease (or a shard session's) ran out: queued again, or failed."""
        requeued = self.store.requeue_expired()
        if requeued:
            self.work.notify()
        return requeued

    def extend_active_leases(self) -> int:
        """After a restart, give agents one lease period to reach us again."""
        return self.store.extend_active_leases(self.settings.lease_seconds)

    def _keep_output(self, key: str) -> tuple[str, str | None, list[tuple[str, int]]]:
        """A replica's output, moved where the machine's upload URL (good for hours) can no
        longer change it, and read there: (its key, its digest, its files). It is compared
        with the others' by what it holds as read here, never by what its machine says. A
        retried call finds it moved already."""
        kept = f"{key.removesuffix('.tar.gz')}-kept.tar.gz"
        if self.objects.exists(key):
            self.objects.copy(key, kept)
            self.objects.delete(key)
        if not self.objects.exists(kept):
            return key, None, []
        digest, files = read_output(self.objects.stream(kept))
        return kept, digest, files

    @staticmethod
    def output_key(job_id: str, attempt: int) -> str:
        return f"outputs/{job_id}/attempt-{attempt}.tar.gz"

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
            datasets=self._compared(job.compare_pair, ttl) if job.compare_pair else {
                ds.name: [DatasetFile(path, self.objects.presign_get(key, ttl, bucket) if key else "",
                                      size, sha)
                          for path, key, size, sha, bucket in self.inputs.files(ds)]
                for ds in job.spec.datasets
            },
            resume=resume,
            resume_url=self.objects.presign_get(resume.key, ttl) if resume else "",
            gpu_uuids=list(claim.gpu_uuids),
            hold=claim.hold(machine_id),
            shard=claim.shard,
            shares={ds.name: ds.share for ds in job.spec.datasets if ds.share},
        )

    def _compared(self, pair: tuple[str, ...], ttl: dt.timedelta) -> dict[str, list[DatasetFile]]:
        """A comparison's inputs: each replica's /output archive as the coordinator kept and
        read it (checked by size and sha256 where it arrives), at /data/a and /data/b."""
        inputs: dict[str, list[DatasetFile]] = {}
        for name, which in zip("ab", pair, strict=True):
            # A checkpoint ("ckpt:<id>") as its machine uploaded it, or a replica's /output.
            key, as_file = ((self.store.checkpoints.key(int(which[5:])), "checkpoint.tar")
                            if which.startswith("ckpt:") else
                            (self.store.get(which).output_key, "output.tar.gz"))
            files = []
            if key and self.objects.exists(key):
                size, sha = self.objects.digest(key)
                files.append(DatasetFile(as_file, self.objects.presign_get(key, ttl), size, sha))
            inputs[name] = files
        return inputs

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
    """Where this attempt's checkpoints of `epoch` go: each upload adds its own suffix."""
    return f"checkpoints/{ref.job_id}/epoch-{epoch:08d}-attempt-{ref.token}-"


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
