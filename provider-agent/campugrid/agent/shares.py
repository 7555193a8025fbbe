"""Folders a provider's owner shares with jobs (`campugrid agent run --share NAME=/path`).

The agent reports each folder's name and its files by path inside it, size and sha256 (never
where the folder is on the host). A job names files by that path and sha256; the agent opens
them inside the listed folder only, one path component at a time with O_NOFOLLOW, so `..`,
absolute paths and symlinks (out of the folder or not) are refused, checks each by size and
sha256, and puts it in the job's read-only /data in place (a hard link) or, where the kernel
does not allow linking the owner's file, as a copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from campugrid.agent.messages import SharedFile
from campugrid.protocol.errors import CampugridError, InvalidInput
from campugrid.protocol.spec import DATASET_NAME_RE

log = logging.getLogger("campugrid.agent.shares")
MAX_SHARES, MAX_FILES = 16, 1000  # what is reported (the coordinator keeps no more)
CHUNK = 1024 * 1024


def parse(specs: list[str]) -> dict[str, Path]:
    """`NAME=/path` pairs, checked: a known name, an existing folder (as the agent's user)."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not DATASET_NAME_RE.match(name):
            raise CampugridError(f"--share {spec!r}: give NAME=/folder (NAME: 1-64 of a-z 0-9 "
                                 "_ . -)")
        folder = Path(path).expanduser()
        if not folder.is_absolute() or not folder.is_dir():
            raise CampugridError(f"--share {name}: {path!r} is not a folder (give its absolute "
                                 "path)")
        if name in out:
            raise CampugridError(f"--share {name}: named twice")
        out[name] = folder.resolve()
    if len(out) > MAX_SHARES:
        raise CampugridError(f"--share: at most {MAX_SHARES} folders")
    return out


class Shares:
    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders
        self._digests: dict[tuple[int, int, int, int], str] = {}  # (dev, ino, size, mtime)
        self._lock = threading.Lock()
        self._listed: dict[str, tuple[SharedFile, ...]] = {}
        if folders:
            threading.Thread(target=self._list_all, daemon=True, name="shares").start()

    def names(self) -> list[str]:
        return sorted(self.folders)

    def listing(self) -> dict[str, tuple[SharedFile, ...]]:
        """What the shares hold, as far as listed yet (hashing runs in the background)."""
        with self._lock:
            return dict(self._listed)

    def _list_all(self) -> None:
        for name, folder in self.folders.items():
            files = []
            for rel in _regular_files(folder):
                try:
                    fd = _open_inside(folder, rel)
                except InvalidInput:
                    continue
                try:
                    size, sha = self._digest(fd)
                finally:
                    os.close(fd)
                files.append(SharedFile(rel, size, sha))
                if len(files) >= MAX_FILES:
                    log.warning("share %s: listing only its first %d files", name, MAX_FILES)
                    break
            with self._lock:
                self._listed[name] = tuple(files)
            log.info("share %s: %d files listed", name, len(files))

    def _digest(self, fd: int) -> tuple[int, str]:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            known = self._digests.get(key)
        if known is not None:
            return st.st_size, known
        h = hashlib.sha256()
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)
        with self._lock:
            self._digests[key] = h.hexdigest()
        return st.st_size, h.hexdigest()

    def place(self, share: str, path: str, sha256: str, target: Path) -> str:
        """Put the share's file `path` at `target` if it is the one the job names: "in place"
        (a hard link) or "copied". InvalidInput, with why, for anything else."""
        folder = self.folders.get(share)
        if folder is None:
            raise InvalidInput(f"this machine does not share {share!r}")
        fd = _open_inside(folder, path)
        try:
            size, digest = self._digest(fd)
            if digest != sha256:
                raise InvalidInput(f"share {share}: {path} is not the file the job names "
                                   f"(sha256 {digest[:16]}…, not {sha256[:16]}…); it changed "
                                   "after the job was submitted, or this machine shares "
                                   "another file by that name")
            target.parent.mkdir(parents=True, exist_ok=True)
            try:  # the very inode just checked, not the path again
                os.link(f"/proc/self/fd/{fd}", target, follow_symlinks=True)
                return "in place"
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK):
                    raise
            os.lseek(fd, 0, os.SEEK_SET)
            copied = hashlib.sha256()
            with open(target, "wb") as out:
                while chunk := os.read(fd, CHUNK):
                    copied.update(chunk)
                    out.write(chunk)
            if copied.hexdigest() != sha256 or target.stat().st_size != size:
                target.unlink(missing_ok=True)
                raise InvalidInput(f"share {share}: {path} changed while it was copied")
            return "copied"
        finally:
            os.close(fd)


def _open_inside(folder: Path, path: str) -> int:
    """An fd of the regular file `path` inside `folder`, walked component by component with
    O_NOFOLLOW: a symlink anywhere, `..`, `.` or an absolute path is refused."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidInput(f"{path!r} is not a path inside a share")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(folder, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            except OSError as e:
                raise InvalidInput(_why(path, e)) from e
            os.close(fd)
            fd = nxt
        try:
            file_fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        except OSError as e:
            raise InvalidInput(_why(path, e)) from e
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise InvalidInput(f"{path!r} in the share is not a regular file")
    return file_fd


def _why(path: str, e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"{path!r} goes through a symlink (or a non-folder); shares are read by real path only"
    if e.errno == errno.ENOENT:
        return f"{path!r} is not in the share"
    return f"{path!r} cannot be opened in the share ({e.strerror})"


def _regular_files(folder: Path) -> Iterator[str]:
    """Paths of the regular files under `folder`, not following symlinks, in a stable order."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(full.lstat().st_mode):
                    yield str(full.relative_to(folder))
