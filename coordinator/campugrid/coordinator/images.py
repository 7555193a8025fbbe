"""Shared images: which machine builds a job's image, and which build the others pull.

A build is named by its key: a digest of the job's context (which holds the Dockerfile) and
of what else decides the result on the machine (builder and version, base image digests).
Machines push what they built to the registry, by the key's repository, and pull by digest:

- "first": the first machine to ask claims the build while its task is live; the others
  wait, then pull its digest. A claim whose task ended (lease lost, push failed) passes on.
  A task that nobody else could use the image for now builds and pushes nothing.
- "verified": every machine builds and pushes until two different machines pushed the same
  digest; from then on it is pulled.
- "never": each machine builds for itself; nothing is pushed or recorded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
from collections import Counter
from typing import Any

from sqlalchemy import delete, exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from campugrid.coordinator.db import Database
from campugrid.coordinator.fence import live
from campugrid.coordinator.machines import Status as MachineStatus
from campugrid.coordinator.models import (
    ImageBuild,
    ImageClaim,
    ImagePull,
    Job,
    JobEvent,
    Machine,
    ShardSession,
)
from campugrid.coordinator.registry import RegistryTokens
from campugrid.coordinator.views import HoldKind, HoldRef, stored_spec, utcnow
from campugrid.protocol.errors import InvalidInput, StaleAttempt
from campugrid.protocol.states import JobState

MAX_INPUTS_BYTES = 4096
CLAIM_S = 3600.0  # a claim holds at most this long, even for a task that stays live
WAIT_S = 2.0  # how soon a waiting machine asks again
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # "pull", "build" or "wait"
    key: str
    digest: str = ""  # pull: the manifest
    built_by: str = ""  # pull: the machine(s) whose build it is
    push: bool = False  # build: push it afterwards


@dataclasses.dataclass(frozen=True)
class ImageAnswer:
    """What the Image call answers a machine."""

    action: str  # resolve: "pull", "build" or "wait"; push: "push"; pushed: "recorded"
    registry: str = ""
    repository: str = ""
    digest: str = ""
    token: str = ""  # bearer token for `repository` only
    push: bool = False
    retry_s: float = 0.0
    built_by: str = ""


# Only builds of approved machines are pulled: a revoked machine's pushes are not, and a
# quarantined machine's are withdrawn for good (verified.quarantine; reinstating it does not
# bring them back). The garbage collector drops them from the registry.
_IN_GOOD_STANDING = ImageBuild.withdrawn_at.is_(None) & ImageBuild.machine_id.in_(
    select(Machine.id).where(Machine.status == MachineStatus.APPROVED.value))


def repository(key: str) -> str:
    """The registry repository of a build key: the one a push token names."""
    return f"campugrid/build-{key}"


def build_key(context_sha256: str, inputs_json: str) -> str:
    """The key from the coordinator's own record of the context and the machine's account of
    the rest: a machine can name builds of the contexts it leased, and no others."""
    if len(inputs_json) > MAX_INPUTS_BYTES:
        raise InvalidInput(f"inputs_json: longer than {MAX_INPUTS_BYTES} bytes")
    try:
        inputs = json.loads(inputs_json)
    except ValueError as e:
        raise InvalidInput(f"inputs_json: not JSON ({e})") from e
    if not isinstance(inputs, dict) or not inputs:
        raise InvalidInput("inputs_json: must be a non-empty JSON object")
    canonical = json.dumps({"context": context_sha256, "inputs": inputs}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _claimed_by(claim: ImageClaim) -> HoldRef:
    return HoldRef(claim.job_id, HoldKind(claim.hold_kind), claim.token, claim.machine_id)


def _others_may_need(s: Session, ref: HoldRef) -> bool:
    """Whether another task may want this job's image while it is still useful: another
    live job of the same context, or more of this sharded job's shards than this session."""
    job = s.get(Job, ref.job_id)
    if job is None:
        return False
    live = [state.value for state in JobState if not state.final]
    if s.scalar(select(Job.id).where(Job.context_sha256 == job.context_sha256,
                                     Job.id != ref.job_id,
                                     Job.state.in_(live)).limit(1)) is not None:
        return True
    if not job.shards_total:
        return False
    mine = ref.token if ref.kind is HoldKind.SESSION else 0
    return job.shards_queued > 0 or s.scalar(
        select(ShardSession.id).where(ShardSession.job_id == ref.job_id, ShardSession.active,
                                      ShardSession.id != mine).limit(1)) is not None


def _event(s: Session, ref: HoldRef, detail: str) -> None:
    """In the job's history, under the attempt (or the shard session, by its id, as the
    sessions' own events are)."""
    s.add(JobEvent(job_id=ref.job_id, at=utcnow(), attempt=ref.token, kind="image",
                   detail=detail))


class Images:
    def __init__(self, db: Database, registry: RegistryTokens | None = None) -> None:
        self.db = db
        self.registry = registry  # None: no registry; every machine builds for itself
        self.collected = 0  # manifests deleted by this process (for the registry's GC)

    def step(self, ref: HoldRef, step: str, inputs_json: str, digest: str = "") -> ImageAnswer:
        """One step of a task's image: "resolve", "push" (a token to push this machine's
        build) or "pushed" (`digest`, or empty when the push failed)."""
        if step not in ("resolve", "push", "pushed"):
            raise InvalidInput("step: resolve, push or pushed")
        context_sha256, reuse = self._task(ref, step)
        if self.registry is None:
            if step != "resolve":
                raise InvalidInput(f"step {step!r}: this coordinator has no image registry")
            return ImageAnswer("build")
        key = build_key(context_sha256, inputs_json)
        repo = repository(key)
        who = f"machine:{ref.machine_id}"
        if step == "resolve":
            d = self.resolve(key=key, reuse=reuse, ref=ref)
            if d.action == "pull":
                return ImageAnswer("pull", self.registry.address, repo, d.digest,
                                   self.registry.mint(who, repo, ("pull",)), built_by=d.built_by)
            return ImageAnswer(d.action, self.registry.address, repo, push=d.push,
                               retry_s=WAIT_S if d.action == "wait" else 0.0)
        if not self.may_push(key=key, reuse=reuse, ref=ref):  # "push" or "pushed"
            raise InvalidInput(f"{step} of {repo}: this task does not build it for others "
                               f"(image.reuse is {reuse!r}); run the local build")
        if step == "push":
            return ImageAnswer("push", self.registry.address, repo,
                               token=self.registry.mint(who, repo, ("push", "pull")))
        if digest and not DIGEST_RE.match(digest):
            raise InvalidInput("digest: expected sha256:<64 hex digits>")
        if digest and not self.registry.has_manifest(repo, digest):
            raise InvalidInput(f"{repo}@{digest} is not in the registry")
        self.record(key=key, context_sha256=context_sha256, digest=digest, ref=ref)
        return ImageAnswer("recorded", self.registry.address, repo, digest)

    def _task(self, ref: HoldRef, step: str) -> tuple[str, str]:
        """The context digest and image.reuse of the live task this machine holds."""
        with self.db.read() as s:
            job = s.get(Job, ref.job_id)
            if job is None or not live(s, ref):
                raise StaleAttempt(f"image {step} refused: {ref.kind.value} {ref.token} of job "
                                   f"{ref.job_id} is not held by this machine")
            return job.context_sha256, stored_spec(job.spec_json).image.reuse

    def resolve(self, *, key: str, reuse: str, ref: HoldRef) -> Decision:
        """What the machine holding this task does for its image (the caller checked that it
        holds the task)."""
        if reuse == "never":
            return Decision("build", key)
        try:
            with self.db.tx() as s:
                return (self._first(s, key, ref) if reuse == "first"
                        else self._verified(s, key, ref))
        except IntegrityError:  # another machine claimed it at the same moment
            return Decision("wait", key)

    def _pull(self, s: Session, key: str, digest: str, builders: list[ImageBuild],
              ref: HoldRef) -> Decision:
        now = utcnow()
        for b in builders:
            b.used_at = now
        by = ", ".join(sorted({b.machine_id for b in builders}))
        makers = {b.machine_id for b in builders}
        s.add(ImagePull(job_id=ref.job_id, digest=digest, at=now,
                        builder=next(iter(makers)) if len(makers) == 1 else None))
        _event(s, ref, f"machine {ref.machine_id} pulls image {digest} built by machine {by} "
                       f"(key {key[:16]}…)")
        return Decision("pull", key, digest=digest, built_by=by)

    def _first(self, s: Session, key: str, ref: HoldRef) -> Decision:
        builds = s.scalars(select(ImageBuild).where(ImageBuild.build_key == key, _IN_GOOD_STANDING)
                           .order_by(ImageBuild.created_at, ImageBuild.id)).all()
        if builds:
            return self._pull(s, key, builds[0].digest, [builds[0]], ref)
        claim = s.get(ImageClaim, key, populate_existing=True)
        now = utcnow()
        if claim is None and not _others_may_need(s, ref):
            # Nobody else could use the image now: build here, push nothing (and claim
            # nothing, so a task that comes later is not made to wait for this one).
            return Decision("build", key)
        if claim is None:
            s.add(ImageClaim(build_key=key, job_id=ref.job_id, hold_kind=ref.kind.value,
                             token=ref.token, machine_id=ref.machine_id,
                             expires_at=now + dt.timedelta(seconds=CLAIM_S)))
            s.flush()  # a concurrent claim fails here (IntegrityError): wait instead
        elif _claimed_by(claim) != ref:
            if claim.expires_at > now and live(s, _claimed_by(claim)):
                return Decision("wait", key)
            taken = s.execute(
                update(ImageClaim)
                .where(ImageClaim.build_key == key, ImageClaim.job_id == claim.job_id,
                       ImageClaim.hold_kind == claim.hold_kind, ImageClaim.token == claim.token)
                .values(job_id=ref.job_id, hold_kind=ref.kind.value, token=ref.token,
                        machine_id=ref.machine_id, expires_at=now + dt.timedelta(seconds=CLAIM_S))
                .execution_options(synchronize_session=False))
            if taken.rowcount != 1:  # type: ignore[attr-defined]
                return Decision("wait", key)
        _event(s, ref, f"machine {ref.machine_id} builds the image for the others "
                       f"(key {key[:16]}…)")
        return Decision("build", key, push=True)

    def _verified(self, s: Session, key: str, ref: HoldRef) -> Decision:
        builds = s.scalars(select(ImageBuild).where(ImageBuild.build_key == key, _IN_GOOD_STANDING)
                           .order_by(ImageBuild.created_at, ImageBuild.id)).all()
        # One vote per party: a machine, or all the machines an admin said one owner has.
        owners = dict(s.execute(select(Machine.id, Machine.owner).where(
            Machine.id.in_(sorted({b.machine_id for b in builds})))).all())
        votes = Counter(d for d, _ in {(b.digest, owners.get(b.machine_id) or b.machine_id)
                                       for b in builds})
        agreed = [d for d, n in votes.most_common() if n >= 2]
        if agreed:
            return self._pull(s, key, agreed[0], [b for b in builds if b.digest == agreed[0]],
                              ref)
        return Decision("build", key, push=not any(b.machine_id == ref.machine_id
                                                   for b in builds))

    def may_push(self, *, key: str, reuse: str, ref: HoldRef) -> bool:
        """Whether this task may push its build of `key`: it holds the claim ("first"), or
        its machine has no build of the key recorded yet ("verified")."""
        if reuse == "never":
            return False
        with self.db.read() as s:
            if reuse == "first":
                claim = s.get(ImageClaim, key)
                return claim is not None and _claimed_by(claim) == ref
            return s.scalar(select(ImageBuild.id).where(
                ImageBuild.build_key == key, ImageBuild.machine_id == ref.machine_id)) is None

    def record(self, *, key: str, context_sha256: str, digest: str, ref: HoldRef) -> None:
        """The machine pushed `digest` for `key` (the caller checked it is in the registry),
        or (`digest` empty) its push failed and its claim passes on."""
        job_id, machine_id = ref.job_id, ref.machine_id
        with self.db.tx() as s:
            s.execute(delete(ImageClaim).where(ImageClaim.build_key == key,
                                               ImageClaim.job_id == job_id,
                                               ImageClaim.hold_kind == ref.kind.value,
                                               ImageClaim.token == ref.token))
            if not digest:
                _event(s, ref, f"machine {machine_id} could not push its image "
                               f"(key {key[:16]}…)")
                return
            now = utcnow()
            row = s.scalar(select(ImageBuild).where(ImageBuild.build_key == key,
                                                    ImageBuild.machine_id == machine_id))
            if row is None:
                s.add(ImageBuild(build_key=key, context_sha256=context_sha256, digest=digest,
                                 machine_id=machine_id, job_id=job_id, created_at=now,
                                 used_at=now))
            else:
                row.digest, row.job_id, row.created_at, row.used_at = digest, job_id, now, now
                row.withdrawn_at = None
            _event(s, ref, f"machine {machine_id} built and pushed image {digest} "
                           f"(key {key[:16]}…)")

    def builds(self, context_sha256: str) -> list[dict[str, Any]]:
        """The recorded builds of one context, oldest first."""
        with self.db.read() as s:
            rows = s.scalars(select(ImageBuild).where(ImageBuild.context_sha256 == context_sha256)
                             .order_by(ImageBuild.created_at, ImageBuild.id)).all()
            return [{"key": r.build_key, "digest": r.digest, "machine_id": r.machine_id,
                     "job_id": r.job_id, "created_at": r.created_at.isoformat()} for r in rows]

    def unneeded(self, idle_for: dt.timedelta) -> list[tuple[str, str]]:
        """(key, digest) of the builds no queued or running job can use (no such job has
        their context) and that nobody pulled for `idle_for`, and the withdrawn ones: what
        the registry may drop."""
        live = [s.value for s in JobState if not s.final]
        kept = aliased(ImageBuild)  # the same digest built by a machine in good standing
        with self.db.read() as s:
            needed = select(Job.context_sha256).where(Job.state.in_(live))
            rows = s.execute(select(ImageBuild.build_key, ImageBuild.digest).where(
                (ImageBuild.withdrawn_at.is_not(None) & ~exists().where(
                    kept.build_key == ImageBuild.build_key, kept.digest == ImageBuild.digest,
                    kept.withdrawn_at.is_(None)))
                | (ImageBuild.context_sha256.not_in(needed)
                   & (ImageBuild.used_at < utcnow() - idle_for))).distinct()).all()
        return [(k, d) for k, d in rows]

    def collect(self, idle_for: dt.timedelta) -> int:
        """Delete from the registry the builds no queued or running job can use (their blobs
        go at the registry's next garbage collection); returns how many."""
        if self.registry is None:
            return 0
        gone = 0
        for key, digest in self.unneeded(idle_for):
            if self.registry.delete_manifest(repository(key), digest):
                self.forget(key, digest)
                gone += 1
        with self.db.tx() as s:  # claims of tasks long gone
            s.execute(delete(ImageClaim).where(ImageClaim.expires_at < utcnow()))
        self.collected += gone
        return gone

    def forget(self, key: str, digest: str) -> None:
        """The registry dropped this build: no machine is sent to pull it again."""
        with self.db.tx() as s:
            s.execute(delete(ImageBuild).where(ImageBuild.build_key == key,
                                               ImageBuild.digest == digest))
