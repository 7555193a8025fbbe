"""Epoch checkpoints from inside a campugrid job: standard library only.

    from campugrid import hooks

    state = hooks.restore()                 # None on a first run
    start = state.epoch + 1 if state else 0
    for epoch in range(start, epochs):
        train_one_epoch()
        with hooks.save(epoch) as folder:   # write files into folder; atomic on exit
            (folder / "weights.bin").write_bytes(...)
        if hooks.stop_requested():          # SIGTERM: the machine is being drained
            break                           # the last checkpoint is already safe

Checkpoints are folders `epoch-NNNNNNNN` under $CAMPUGRID_CHECKPOINT_DIR, each with a
MANIFEST.json (file sizes and sha256) written last and renamed into place, so a folder
with a valid manifest is complete. The agent uploads each one and restores the latest
before a resumed attempt; jobs never hold storage credentials nor need a network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV_DIR = "CAMPUGRID_CHECKPOINT_DIR"
MANIFEST = "MANIFEST.json"
PREFIX = "epoch-"
_NAME = re.compile(r"epoch-[0-9]{1,18}")

__all__ = ["Checkpoint", "checkpoint_dir", "install_sigterm_handler", "latest", "regular_files",
           "restore", "save", "save_folder", "serve_shards", "sha256_file", "stop_requested",
           "verify"]


class CheckpointError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    epoch: int
    path: Path
    meta: dict[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name


def checkpoint_dir(root: str | os.PathLike[str] | None = None) -> Path:
    path = Path(root or os.environ.get(ENV_DIR) or "./checkpoints")
    path.mkdir(parents=True, exist_ok=True)
    return path


def folder_name(epoch: int) -> str:
    return f"{PREFIX}{epoch:08d}"


def regular_files(root: Path) -> list[Path]:
    """Every regular file under root, never following a symbolic link (a job could point one
    anywhere on the host that reads the folder)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            p = Path(dirpath, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                found.append(p)
    return sorted(found)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1024 * 1024), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def save(epoch: int, meta: dict[str, Any] | None = None,
         root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Yield an empty folder; on a clean exit it becomes checkpoint `epoch`, atomically."""
    if not isinstance(epoch, int) or epoch < 0:
        raise CheckpointError(f"epoch must be a non-negative integer, not {epoch!r}")
    base = checkpoint_dir(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}{epoch}-", dir=base))
    try:
        yield tmp
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_symlink():
                raise CheckpointError(f"{p.relative_to(tmp)}: links are not kept in checkpoints")
        for p in regular_files(tmp):
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            files[str(p.relative_to(tmp))] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        manifest = {"epoch": epoch, "files": files, "meta": meta or {}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        final = base / folder_name(epoch)
        if final.exists():  # the same epoch saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_folder(epoch: int, source: str | os.PathLike[str], meta: dict[str, Any] | None = None,
                root: str | os.PathLike[str] | None = None) -> Path:
    """Framework-free mode: checkpoint a copy of a folder of files."""
    with save(epoch, meta, root) as folder:
        shutil.copytree(source, folder, dirs_exist_ok=True, symlinks=False)
    return checkpoint_dir(root) / folder_name(epoch)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint folder; CheckpointError if anything is off."""
    if path.is_symlink() or (path / MANIFEST).is_symlink():
        raise CheckpointError(f"{path.name}: links are not allowed in checkpoints")
    try:
        manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path.name}: no readable manifest ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or not isinstance(manifest.get("epoch"), int)
            or not all(isinstance(v, dict) and isinstance(v.get("size"), int)
                       and isinstance(v.get("sha256"), str) for v in files.values())):
        raise CheckpointError(f"{path.name}: the manifest is not one that campugrid.hooks wrote")
    present = {str(p.relative_to(path)) for p in regular_files(path)} - {MANIFEST}
    listed = set(manifest.get("files", {}))
    if present != listed:
        raise CheckpointError(f"{path.name}: files differ from the manifest "
                              f"(extra {sorted(present - listed)}, missing {sorted(listed - present)})")
    for name, want in manifest["files"].items():
        p = path / name
        if p.stat().st_size != want["size"] or sha256_file(p) != want["sha256"]:
            raise CheckpointError(f"{path.name}/{name}: size or sha256 does not match the manifest")
    return manifest


def complete(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Folders that look complete (a manifest is present), oldest epoch first."""
    base = checkpoint_dir(root)
    found = [p for p in base.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()
             and not p.is_symlink() and (p / MANIFEST).is_file()
             and not (p / MANIFEST).is_symlink()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | os.PathLike[str] | None = None) -> Checkpoint | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped."""
    for path in reversed(complete(root)):
        try:
            manifest = verify(path)
        except CheckpointError:
            continue
        return Checkpoint(int(manifest["epoch"]), path, manifest.get("meta", {}))
    return None


restore = latest

_stop = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    _stop.set()


def stop_requested() -> bool:
    """True once the job was asked to stop (SIGTERM): save and exit within the grace period.

    The first call installs the SIGTERM handler: a loop that asks is a loop that will stop
    cleanly; one that never asks keeps SIGTERM's default (its last checkpoint still counts).
    """
    install_sigterm_handler()
    return _stop.is_set()


_installed = False


def install_sigterm_handler() -> None:
    global _installed
    if not _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True


from campugrid.hooks.shards import serve_shards  # noqa: E402  (sharded jobs)
