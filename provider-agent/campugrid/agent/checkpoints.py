"""Moves a task's epoch checkpoints between its mounted folder and object storage.

The job (through campugrid.hooks) writes `epoch-N/` folders with a manifest; this uploads
each complete one as a tar through presigned multipart URLs and has the coordinator record it.
A partial or damaged folder is never uploaded. On a resumed attempt, the latest recorded
checkpoint is downloaded, its digest checked, and unpacked before the job starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx

from campugrid import hooks
from campugrid.agent.client import CoordinatorApi
from campugrid.agent.messages import CheckpointRecord, Hold, Resume
from campugrid.agent.metrics import METRICS
from campugrid.buildpolicy.tarballs import extract_checkpoint
from campugrid.protocol import logs
from campugrid.protocol.errors import CampugridError, InvalidInput
from campugrid.sandbox import confine

log = logging.getLogger("campugrid.agent.checkpoints")
# A checkpoint may be as large as the coordinator accepts (64 GiB): unpacked and hashed in a
# stream, so little memory, but files and time to match.
CHECKPOINT_LIMITS = confine.Limits(memory_mb=256, cpu_s=900, fsize_mb=64 * 1024, nofile=256,
                                   wall_s=3600)


def restore(resume: Resume, folder: Path, scratch: Path) -> None:
    """Download the checkpoint to resume from, check it, and unpack it into `folder`."""
    tarball = scratch / "resume.tar"
    with httpx.Client(timeout=300) as http, http.stream("GET", resume.url) as resp:
        resp.raise_for_status()
        with open(tarball, "wb") as out:
            for chunk in resp.iter_bytes(1024 * 1024):
                out.write(chunk)
    size, digest = tarball.stat().st_size, hooks.sha256_file(tarball)
    if (size, digest) != (resume.size, resume.sha256):
        raise InvalidInput(f"checkpoint of epoch {resume.epoch} arrived damaged "
                           f"({size} bytes, sha256 {digest[:12]}…); not resuming from it")
    target = folder / hooks.folder_name(resume.epoch)
    # Untrusted bytes (another machine's job wrote them): unpacked and checked confined.
    confine.call(extract_checkpoint, tarball.resolve(), target.resolve(),
                 writable=[target.resolve()], limits=CHECKPOINT_LIMITS)
    tarball.unlink()


def snapshot(src: Path, dst: Path) -> None:
    """Copy the regular files of a folder the job can still change, through directory file
    descriptors and O_NOFOLLOW, so that swapping a file or folder for a link mid-copy cannot
    make the agent read a host path. Everything after works on the private copy."""
    for dirpath, _dirs, files, dirfd in os.fwalk(src, follow_symlinks=False):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dirfd)
            except OSError:
                continue  # a link, or gone: not part of the checkpoint
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    continue
                with open(dst / rel / name, "wb") as out:
                    shutil.copyfileobj(f, out)


def _label(path: Path) -> str:
    """The name the job's own code gave a checkpoint autosave took (its manifest's meta),
    made safe to show: printable, at most 200 characters; "" for campugrid.hooks' epochs."""
    try:
        meta = json.loads((path / hooks.MANIFEST).read_text()).get("meta") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    entries = meta.get("entries") if isinstance(meta, dict) else None
    if not isinstance(entries, list):
        return ""
    named = ", ".join(e for e in entries if isinstance(e, str))
    return "".join(ch for ch in named if ch.isprintable())[:200]


class CheckpointUploader:
    """Polls the folder while the job runs; `flush()` does a last pass after it stopped."""

    def __init__(self, client: CoordinatorApi, hold: Hold, folder: Path, scratch: Path,
                 every_s: float = 1.0, on_recorded: Callable[[], None] = lambda: None) -> None:
        self.client, self.hold = client, hold
        # After each checkpoint is recorded: a task that recomputes one to check it ends once
        # it is recorded, and the renewal this calls hears so at once.
        self.on_recorded = on_recorded
        self.folder, self.scratch, self.every_s = folder, scratch, every_s
        self.done: set[str] = set()  # uploaded, or damaged and given up on
        self.uploaded: list[int] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = logs.thread(self._loop, name=f"ckpt-{hold.job_id}")

    def start(self) -> CheckpointUploader:
        self._thread.start()
        return self

    def flush(self) -> None:
        self.stop()
        self.scan()

    def stop(self, wait: bool = True) -> None:
        """No more polling (the last pass is flush's); `wait` for a pass in progress."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=600)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.scan()
            except httpx.HTTPStatusError as e:  # str(e) would include the presigned URL
                log.warning("%s: checkpoint upload got HTTP %d, will retry", self.hold.job_id,
                            e.response.status_code)
            except (grpc.RpcError, httpx.HTTPError, OSError, CampugridError) as e:
                log.warning("%s: checkpoint upload failed, will retry: %s", self.hold.job_id,
                            type(e).__name__ if isinstance(e, httpx.HTTPError) else e)
            except Exception:  # a bug here must not silently end checkpointing
                log.exception("%s: checkpoint scan failed, will retry", self.hold.job_id)

    def scan(self) -> None:
        with self.lock:
            for path in hooks.complete(self.folder):
                if path.name not in self.done:
                    self._take(path)

    def _take(self, path: Path) -> None:
        """Snapshot, verify, upload, record one epoch folder; damaged ones are skipped for good."""
        copy = self.scratch / f"snapshot-{path.name}"
        shutil.rmtree(copy, ignore_errors=True)
        try:
            snapshot(path, copy)
            manifest = hooks.verify(copy)
            if manifest.get("epoch") != int(path.name[len(hooks.PREFIX):]):
                raise hooks.CheckpointError(f"{path.name}: its manifest names another epoch")
            self._upload(int(manifest["epoch"]), copy)
        except hooks.CheckpointError as e:
            log.warning("%s: not uploading %s: %s", self.hold.job_id, path.name, e)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        self.done.add(path.name)
        self._prune_local(keep=path.name)

    def _upload(self, epoch: int, path: Path) -> None:
        tarball = self.scratch / f"checkpoint-{epoch}.tar"
        with tarfile.open(tarball, "w") as tar:
            for p in hooks.regular_files(path):
                tar.add(p, arcname=str(p.relative_to(path)), recursive=False)
        size, digest = tarball.stat().st_size, hooks.sha256_file(tarball)
        began = time.monotonic()
        begin = self.client.begin_checkpoint(self.hold, epoch, size)
        if not begin.accepted:
            raise CampugridError(f"checkpoint of epoch {epoch} refused: {begin.reason}")
        etags = []
        with httpx.Client(timeout=300) as http, open(tarball, "rb") as f:
            for url in begin.part_urls:
                part = f.read(begin.part_size)
                resp = http.put(url, content=part)
                resp.raise_for_status()
                if "etag" not in resp.headers:
                    raise CampugridError("object storage answered a part upload without an ETag")
                etags.append(resp.headers["etag"])
        reply = self.client.record_checkpoint(self.hold, CheckpointRecord(
            epoch=epoch, key=begin.key, upload_id=begin.upload_id, etags=tuple(etags),
            size=size, sha256=digest, label=_label(path)))
        tarball.unlink()
        if not reply.accepted:
            raise CampugridError(f"checkpoint of epoch {epoch} refused: {reply.reason}")
        METRICS.checkpoint_upload_seconds.observe(time.monotonic() - began)
        METRICS.checkpoint_bytes.inc(size)
        self.uploaded.append(epoch)
        log.info("%s: checkpoint of epoch %d uploaded (%d bytes)", self.hold.job_id, epoch, size)
        self.on_recorded()

    def _prune_local(self, keep: str) -> None:
        """Uploaded epochs older than the newest are only taking the provider's disk."""
        for path in hooks.complete(self.folder):
            if path.name != keep and path.name in self.done and path.name < keep:
                shutil.rmtree(path, ignore_errors=True)
