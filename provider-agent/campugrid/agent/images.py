"""A task's image through the shared registry, and this machine's bounded cache of images.

    resolve (Image call) -> "pull": from the cache, else skopeo pulls it by digest
                         -> "wait": another machine builds it; ask again
                         -> "build": build here; with `push`, push it (a token for the one
                            repository the build key names), then report the digest

Images cross only as data: skopeo copies manifests and layers between the registry and this
user's containers-storage, outside any sandbox but running nothing from them; whatever runs
still runs under gVisor. Pulls name a digest, never a tag. Without skopeo, or when the
coordinator has no registry, every image is built here, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from campugrid.agent.client import CoordinatorApi
from campugrid.agent.messages import Hold, ImageStep, Lease
from campugrid.agent.metrics import METRICS
from campugrid.builders.base import Builder
from campugrid.buildpolicy.dockerfiles import BaseUse
from campugrid.protocol.errors import BuildFailed, SandboxError
from campugrid.protocol.spec import BuildOptions
from campugrid.sandbox import store_lock
from campugrid.sandbox.podman_ops import PodmanOps
from campugrid.sandbox.process import LogFn, run_streaming

log = logging.getLogger("campugrid.agent")
CACHE_PREFIX = "localhost/campugrid-cache/"
TRANSFER_TIMEOUT_S = 1800
WAIT_LIMIT_S = 1800  # at most this long for another machine's build, then build here


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


COPIES = 2  # what a cached base takes on disk, in images (ImageCache's docstring)


class ImageCache:
    """Images this machine pulled or pushed, by manifest digest, kept for later tasks of the
    same build: at most `max_images` and `max_mb` together, least recently used dropped
    first, never one a task uses: each task that looks up or pulls an image holds it until
    it releases what it used, and the cache is trimmed then (a removal is `podman rmi
    --force`, which would take a running container with it). The index lives in the
    agent's state folder; images are named under CACHE_PREFIX and this agent's scope, which
    its sweeps do not touch.

    Each image counts at what it takes on disk once used: a base COPIES times its size (it is
    copied into the builder's store of allowed bases; the copy goes with the cached image), a
    job image once (a sandbox starts from its layers as stored:
    tests/integration/test_image_cache.py holds Podman to that). `copies` says which, where
    an image is added or looked up; an image cached as a job's and then used as a base counts
    as a base from then on."""

    def __init__(self, state_dir: Path, scope: str, ops: PodmanOps, max_images: int = 8,
                 max_mb: int = 20480, skopeo: str = "skopeo") -> None:
        self.index_file = state_dir / "images.json"
        self.blobs_file = state_dir / "pushed-blobs.json"  # see _remember
        self.scope, self.max_images, self.max_mb = scope or "agent", max_images, max_mb
        self.ops = ops  # the sandbox's (Runtime.ops)
        self.skopeo = shutil.which(skopeo)
        self._lock = threading.Lock()
        # image -> the tasks using it (by lease): one task's end leaves it to the others
        self._users: dict[str, set[str]] = {}
        self._layer_index: list[Path] | None = None

    def largest_bytes(self, copies: int = 1) -> int:
        """The largest image worth pulling into this cache: one that, counted `copies` times,
        fits its size bound."""
        return self.max_mb * 1024**2 // copies

    @property
    def available(self) -> bool:
        """Whether this machine can move images to and from a registry at all."""
        return self.skopeo is not None

    def name(self, digest: str) -> str:
        return f"{CACHE_PREFIX}{self.scope}:{digest.removeprefix('sha256:')}"

    def _index(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.index_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self, index: dict[str, dict[str, float]]) -> None:
        tmp = self.index_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(self.index_file)

    def lookup(self, digest: str, user: str | None = None, copies: int = 1) -> str | None:
        """The local image of this digest, if the cache has it (and it is still there); in
        use by `user` (a task) from then on, until it calls release; counted `copies` times
        from then on if it counted fewer."""
        image = self.name(digest)
        with self._lock:
            index = self._index()
            if digest not in index:
                return None
            if self.ops.image_size(image) is None:
                del index[digest]
                self._save(index)
                return None
            entry = index[digest]
            entry["used"] = time.time()
            counted = entry.get("copies", COPIES)  # (an index written before it said)
            if counted < copies:
                entry["mb"], entry["copies"] = entry["mb"] / counted * copies, copies
            self._save(index)
            if user is not None:
                self._users.setdefault(image, set()).add(user)
        return image

    def add(self, digest: str, image: str, user: str | None = None, copies: int = 1) -> None:
        """Record an image now in the store under self.name(digest), counted `copies` times,
        in use by `user` if given (until it calls release), then trim the cache."""
        size = self.ops.image_size(image) or 0
        with self._lock:
            if user is not None:
                self._users.setdefault(image, set()).add(user)
            index = self._index()
            index[digest] = {"used": time.time(), "mb": copies * size / 1024**2,
                             "copies": copies}
            self._save(index)
        self.trim()

    def in_use(self) -> set[str]:
        with self._lock:
            return set(self._users)

    def release(self, user: str) -> list[str]:
        """`user` (a task) is done with the images it used: those no other task uses may go
        now, and the cache goes back within its bounds (an image over them stayed only
        because a task used it). Returns the digests removed."""
        with self._lock:
            for image in list(self._users):
                self._users[image].discard(user)
                if not self._users[image]:
                    del self._users[image]
        return self.trim()

    def trim(self) -> list[str]:
        """Drop the least recently used images beyond the bounds; returns their digests."""
        gone = []
        with self._lock:
            index = self._index()
            order = sorted(index, key=lambda d: index[d]["used"])
            while order and (len(index) > self.max_images
                             or sum(e["mb"] for e in index.values()) > self.max_mb):
                victim = next((d for d in order if self.name(d) not in self._users), None)
                if victim is None:
                    break
                order.remove(victim)
                if not self.ops.remove_image(self.name(victim)):
                    break  # another agent of this user is writing to the store: next time
                del index[victim]
                gone.append(victim)
            self._save(index)
        return gone

    def pull(self, registry: str, repository: str, digest: str, token: str | None, *,
             work: Path, limit_bytes: int, cancel: threading.Event | None,
             insecure: bool | None = None, log: LogFn | None = None,
             user: str | None = None, copies: int = 1) -> str:
        """Pull an image by digest, held to `limit_bytes` unpacked: its blobs land in an OCI
        folder under `work` first (skopeo checks each against its digest), each layer is
        counted as it would unpack, and only an image within the limit goes into the store.
        Layers this machine's store already holds are neither downloaded nor counted (they
        take no new space): they stand in the folder as empty files, which the store never
        reads because it reuses its own layer of that digest; should it not, that copy fails
        and the pull is made again in full. `token`: the coordinator's, for its registry
        (None: anonymous); `insecure`: plain HTTP (default: for a loopback address); `log`
        hears how much has come, every few seconds; `user`: the task the image is in use by
        once stored (see lookup); `copies`: see add. Raises SandboxError for anything else."""
        image = self.name(digest)
        staged = work / "pulled"
        plain = _loopback(registry) if insecure is None else insecure
        source = [*(["--src-registry-token", token] if token else ["--src-no-creds"]),
                  *(["--src-tls-verify=false"] if plain else []),
                  f"docker://{registry}/{repository}@{digest}"]
        held = self.held_layers()
        try:
            for attempt in (held, set()):
                shutil.rmtree(staged, ignore_errors=True)
                blobs = staged / "blobs" / "sha256"
                blobs.mkdir(parents=True)
                for layer in attempt:
                    (blobs / layer.removeprefix("sha256:")).touch()
                with _progress(staged, log):
                    self._copy([*source, f"oci:{staged}:pulled"],
                               f"pulling {repository}@{digest}", cancel)
                unpacked_bytes(staged, limit_bytes, skip=attempt)
                try:
                    with store_lock.writing():
                        self._copy([f"oci:{staged}:pulled", f"containers-storage:{image}"],
                                   f"storing {repository}@{digest}", cancel)
                    break
                except SandboxError:
                    if not attempt or (cancel is not None and cancel.is_set()):
                        raise
                    if log is not None:
                        log("[campugrid] the store did not reuse its own layers; pulling "
                            "them in full")
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self.add(digest, image, user, copies)
        return image

    def held_layers(self) -> set[str]:
        """The digests of the layers in this user's store, as the store recorded them when it
        made each layer (of the blob it unpacked and of the unpacked content), and the blobs
        this machine pushed of layers still there: the blobs a pull need not fetch. Read from
        containers-storage's own layer index; empty if that cannot be read (then everything
        is fetched)."""
        try:
            if self._layer_index is None:
                self._layer_index = self.ops.layer_index()
            held: set[str] = set()
            for index in self._layer_index:
                if index.exists():
                    for layer in json.loads(index.read_text()):
                        held.update(str(layer[k]) for k in ("compressed-diff-digest",
                                                            "diff-digest") if layer.get(k))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("cannot read the store's layer index (%s); pulls fetch every layer", e)
            return set()
        return held | {b for b, d in self._blobs().items() if d in held}

    def manifest(self, registry: str, repository: str, digest: str,
                 token: str) -> dict[str, Any]:
        """The image manifest stored under this digest (skopeo checks it against the digest).
        Raises SandboxError if it cannot tell."""
        assert self.skopeo is not None
        try:
            out = subprocess.run(
                [self.skopeo, "inspect", "--raw", "--registry-token", token,
                 *(["--tls-verify=false"] if _loopback(registry) else []),
                 f"docker://{registry}/{repository}@{digest}"],
                capture_output=True, text=True, timeout=120, check=False)
            manifest = json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            raise SandboxError(f"cannot read the manifest of {repository}@{digest}") from e
        if not isinstance(manifest, dict):
            raise SandboxError(f"cannot read the manifest of {repository}@{digest}")
        return manifest

    def download_bytes(self, registry: str, repository: str, digest: str, token: str) -> int:
        """What pulling this manifest would download at most: its config and layers, as the
        manifest states their (compressed) sizes. Raises SandboxError if it cannot tell."""
        manifest = self.manifest(registry, repository, digest, token)
        try:
            return sum(int(p["size"]) for p in [manifest["config"], *manifest["layers"]])
        except (ValueError, KeyError, TypeError) as e:
            raise SandboxError(f"cannot read the manifest of {repository}@{digest}") from e

    def push(self, image: str, registry: str, repository: str, tag: str, token: str,
             work: Path, *, cancel: threading.Event | None) -> str:
        """Push a local image; returns the manifest digest the registry stored."""
        digest_file = work / "pushed.digest"
        self._copy(["--dest-registry-token", token, "--digestfile", str(digest_file),
                    *(["--dest-tls-verify=false"] if _loopback(registry) else []),
                    f"containers-storage:{image}", f"docker://{registry}/{repository}:{tag}"],
                   f"pushing to {repository}", cancel)
        digest = digest_file.read_text().strip()
        # Kept under its digest too, for this machine's later tasks of the same build.
        self.ops.tag(image, self.name(digest))
        self.add(digest, self.name(digest))
        with contextlib.suppress(SandboxError):
            self._remember(self.manifest(registry, repository, digest, token), image)
        return digest

    def _remember(self, pushed: dict[str, Any], image: str) -> None:
        """Note which compressed blob of a push holds which of our own layers, so that a
        later pull of an image with that blob knows the store has it. Only for images built
        here: their layer list was written by our builder, not by a job or another machine."""
        diff_ids = self.ops.image_layers(image) or []
        blobs = [str(layer.get("digest")) for layer in pushed.get("layers") or []
                 if isinstance(layer, dict)]
        if len(blobs) != len(diff_ids):
            return
        held = self.held_layers()
        with self._lock:
            known = {b: d for b, d in self._blobs().items() if d in held}
            known.update(zip(blobs, diff_ids, strict=True))
            tmp = self.blobs_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(self.blobs_file)

    def _blobs(self) -> dict[str, str]:
        try:
            data = json.loads(self.blobs_file.read_text())
        except (OSError, ValueError):
            return {}
        return {str(b): str(d) for b, d in data.items()} if isinstance(data, dict) else {}

    def _copy(self, args: list[str], what: str, cancel: threading.Event | None) -> None:
        assert self.skopeo is not None
        done = run_streaming([self.skopeo, "copy", "--quiet", *args], log=lambda _line: None,
                             timeout_s=TRANSFER_TIMEOUT_S, cancel=cancel, on_orphan=())
        if done.returncode != 0 or done.cancelled or done.timed_out:
            why = ("cancelled" if done.cancelled else "timed out" if done.timed_out
                   else done.tail.strip().splitlines()[-1:] or ["failed"])
            raise SandboxError(f"{what}: {why if isinstance(why, str) else why[0]}"[:1000])

    def sweep_unknown(self) -> list[str]:
        """Cached images the index does not know (a crash between pull and record)."""
        prefix = f"{CACHE_PREFIX}{self.scope}:"
        known = {self.name(d) for d in self._index()}
        return [ref for ref in self.ops.images()
                if ref.startswith(prefix) and ref not in known and self.ops.remove_image(ref)]


@contextlib.contextmanager
def _progress(folder: Path, log: LogFn | None, every_s: float = 5.0) -> Iterator[None]:
    """While the block runs, tell `log` every `every_s` seconds how much is in `folder`."""
    if log is None:
        yield
        return
    done = threading.Event()
    began = time.monotonic()

    def report() -> None:
        while not done.wait(every_s):
            size = 0
            for f in folder.rglob("*"):  # skopeo writes and renames as this reads
                with contextlib.suppress(OSError):
                    size += f.stat().st_size
            log(f"[campugrid] pulled {size / 1024**2:.0f} MB in "
                f"{time.monotonic() - began:.0f} s")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def unpacked_bytes(staged: Path, limit: int, skip: set[str] | frozenset[str] = frozenset()) -> int:
    """What the image skopeo copied into `staged` (an OCI layout of one image) takes once
    unpacked: every layer's files but those in `skip`, each counted with its tar header (so
    a million empty files count too), read through its compression (told by its first bytes:
    gzip, bzip2, xz or none). Raises SandboxError as soon as the total passes `limit`, or for
    a layer that cannot be read this way (zstd among them: our agents push gzip)."""
    blobs = staged / "blobs" / "sha256"
    try:
        index = json.loads((staged / "index.json").read_text())
        manifest = json.loads((blobs / index["manifests"][0]["digest"].removeprefix(
            "sha256:")).read_text())
        layers = [str(layer["digest"]) for layer in manifest["layers"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise SandboxError("the pulled image has no readable manifest") from e
    total = 0
    for layer in layers:
        if layer in skip:
            continue
        try:
            with (blobs / layer.removeprefix("sha256:")).open("rb") as raw, \
                    tarfile.open(fileobj=raw, mode="r|*") as tar:
                for member in tar:
                    total += member.size + tarfile.BLOCKSIZE
                    if total > limit:
                        raise SandboxError(f"it unpacks to more than {limit // 1024**2} MB")
        except (OSError, tarfile.TarError, EOFError) as e:  # tarfile wraps the codecs
            raise SandboxError(f"a layer of the pulled image cannot be read ({e})") from e
    return total


def declared(build: BuildOptions) -> dict[str, str]:
    """The spec's build options as a build input: two jobs of one context that build
    differently (online or offline) do not share an image (none when the spec sets none, so
    the keys of such builds stay as they were)."""
    if build == BuildOptions():
        return {}
    return {"build": json.dumps(dataclasses.asdict(build), sort_keys=True)}


def task_user(lease: Lease) -> str:
    """Whom the cache holds an image for: the task of this lease."""
    return f"{lease.job_id}:{lease.fencing_token}"


@dataclasses.dataclass(frozen=True)
class ImageJob:
    """What a task needs of its image: the lease it holds, the builder and the bases its
    Dockerfile starts from, the tag a build here makes (`build` makes it, within `disk_mb`),
    where it works and logs, and `declared`: what else decides the build besides the builder
    and the bases (the spec's build options), part of the build's key."""

    lease: Lease
    builder: Builder
    bases: Sequence[BaseUse]
    tag: str
    work: Path
    log: LogFn
    stop: threading.Event
    build: Callable[[], None]
    disk_mb: int
    declared: Mapping[str, str] | None = None

    def inputs(self) -> str:
        """What the coordinator keys the build by, besides the context."""
        return json.dumps({**self.builder.inputs(self.bases), **(self.declared or {})},
                          sort_keys=True)

    def built_here(self) -> str:
        self.build()
        return self.tag


def obtain(client: CoordinatorApi, cache: ImageCache | None, job: ImageJob,
           later: Callable[[Callable[[], object]], None] | None = None) -> str:
    """The local image the task runs, in steps: ask the coordinator where it comes from
    (resolve), wait while another machine builds it, then pull that build (`_pull`), or
    build it here and share it (`_share`) when the coordinator says so. `later`: runs the
    push beside the task (which then runs `job.tag`, and must wait for it before it reports
    or removes it), so the job starts without waiting on it; without it, the push comes
    first. Raises BuildFailed for the job's own faults; SandboxError or grpc errors for this
    machine's."""
    if cache is None or not cache.available:
        return job.built_here()
    inputs, hold = job.inputs(), job.lease.hold
    since = time.monotonic()
    step = _accepted(client.image(hold, "resolve", inputs))
    if step.action == "wait":
        job.log("[campugrid] another machine is building this image; waiting to pull it")
    while step.action == "wait":
        if job.stop.wait(max(0.5, step.retry_seconds)):
            raise BuildFailed("stopped while waiting for another machine's build", "")
        if time.monotonic() - since > WAIT_LIMIT_S:
            job.log(f"[campugrid] waited {WAIT_LIMIT_S} s for another machine's build; "
                    "building here")
            return job.built_here()
        step = _accepted(client.image(hold, "resolve", inputs))
    if step.action == "pull":
        return _pull(cache, job, step)
    job.build()
    share = functools.partial(_share, client, cache, hold, inputs, job.tag, job.work, job.log,
                              job.stop)
    if step.push and later is not None:
        later(share)
    elif step.push:  # the cache keeps the image under its digest too, in use by none
        share()
    return job.tag


def _pull(cache: ImageCache, job: ImageJob, step: ImageStep) -> str:
    """Another machine's build, from the cache or the registry; built here instead when it
    cannot be pulled."""
    user = task_user(job.lease)
    found = cache.lookup(step.digest, user)
    if found is not None:
        METRICS.build_cache_hits.labels("cache").inc()
        job.log(f"[campugrid] image {step.digest} (built by machine {step.built_by}) is "
                "already on this machine")
        return found
    began = time.monotonic()
    # Another machine's build is held to what a build here could make: the bases plus
    # `disk_mb`, as the manifest states its compressed sizes before the download, and then
    # as it unpacks before it enters the store.
    allowed = sum(cache.ops.image_size(u.allowed.name) or 0 for u in job.bases) \
        + job.disk_mb * 1024**2
    try:
        size = cache.download_bytes(step.registry, step.repository, step.digest, step.token)
        if size > allowed:
            raise SandboxError(f"it is {size // 1024**2} MB, more than the bases and "
                               f"resources.build_mb ({allowed // 1024**2} MB)")
        found = cache.pull(step.registry, step.repository, step.digest, step.token,
                           work=job.work, limit_bytes=allowed, cancel=job.stop, user=user)
    except SandboxError as e:
        if job.stop.is_set():
            raise BuildFailed("stopped while pulling the image", "") from e
        job.log(f"[campugrid] the image could not be pulled ({e}); building it here")
        return job.built_here()
    METRICS.build_cache_hits.labels("registry").inc()
    job.log(f"[campugrid] pulled image {step.digest} (built by machine {step.built_by}) "
            f"in {time.monotonic() - began:.1f} s")
    size = cache.ops.image_size(found) or 0
    if size > cache.largest_bytes():
        job.log(f"[campugrid] the image's {size // 1024**2} MB are more than this machine's "
                f"image cache holds ({cache.max_mb} MB, --image-cache-mb): it is removed when "
                "this task ends")
    return found


def _share(client: CoordinatorApi, cache: ImageCache, hold: Hold, inputs: str, tag: str,
           work: Path, log: LogFn, stop: threading.Event) -> None:
    """Push this machine's build for the others, and report what was pushed (nothing, if
    the push failed: then another machine may build). The task runs its image either way."""
    digest = ""
    began = time.monotonic()
    try:
        grant = _accepted(client.image(hold, "push", inputs))
        digest = cache.push(tag, grant.registry, grant.repository,
                            f"machine-{client.machine_id}", grant.token, work, cancel=stop)
        log(f"[campugrid] pushed image {digest} for the other machines in "
            f"{time.monotonic() - began:.1f} s")
    except (SandboxError, OSError, grpc.RpcError) as e:
        why = e.details() if isinstance(e, grpc.RpcError) else str(e)
        log(f"[campugrid] the image was not shared ({why}); this task runs it anyway")
    try:
        done = client.image(hold, "pushed", inputs, digest)
        if not done.accepted:
            log(f"[campugrid] the pushed image was not recorded: {done.reason}")
    except grpc.RpcError as e:
        log(f"[campugrid] the pushed image was not recorded: {e.details()}")


def _accepted(step: ImageStep) -> ImageStep:
    """A refused step means the task is no longer this machine's (its lease is gone)."""
    if not step.accepted:
        raise SandboxError(f"image step refused: {step.reason}")
    return step
