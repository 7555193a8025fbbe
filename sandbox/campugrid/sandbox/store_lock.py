"""One lock per provider user over its Podman store, shared by every agent of that user.

c/storage leaves a window in which removing an image deletes what another process is
committing at that moment (Podman's troubleshooting guide, "image not known"; podman#18659):
an image record that a build or pull is adding its name to (campugrid's reproducible builds
give the same image ID to every build of one context), or a layer it has just found and is
about to reference. Two agents of one user (a state folder each, one store) hit it: one
agent's job failed to start with "image not known" as the other removed its finished job's
image. So what adds names or layers to the store holds the lock shared, for as long as it
writes, and what removes images holds it alone; a removal that cannot have it soon is left to
a later sweep rather than keeping a task waiting on a neighbour's build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

REMOVE_WAIT_S = 2.0  # how long a removal waits for writers to finish before it is left


def data_dir() -> Path:
    """The user's campugrid data, which every agent of the user shares (not a state folder):
    $XDG_DATA_HOME/campugrid, by default ~/.local/share/campugrid."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "campugrid"


def path() -> Path:
    """The user's lock file, beside their other campugrid data (every agent of the user must
    find the same one)."""
    return data_dir() / "store.lock"


def _open() -> int:
    lock = path()
    lock.parent.mkdir(parents=True, exist_ok=True)
    return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Held while adding an image, a name or layers to the store (waits for a removal)."""
    fd = _open()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def removing(wait_s: float = REMOVE_WAIT_S) -> Iterator[bool]:
    """Held alone while removing images: yields whether it was had within `wait_s` (if not,
    the caller leaves the image for later)."""
    fd = _open()
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    held = False
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)
