"""Output slots: a size-bounded filesystem for a job's /output and /checkpoints, rootless.

Rootless Podman has no quota for bind mounts, and this kernel gives an unprivileged user
no bounded filesystem on disk (no FUSE, no loop devices). So root makes them once, at
install, as it delegates the cgroups: `infra/setup.sh` creates a few sparse ext4 images and
mounts them at /var/lib/campugrid/slots/N, owned by the provider user. An agent takes one
for its lifetime (an exclusive flock, gone with the agent), and before each task fills it
with a ballast file (fallocate: instant, writes nothing, so the image stays sparse) until
only the task's output_mb is left. The kernel then refuses the byte past the limit
("No space left on device"), however many files the job writes at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from campugrid.protocol.errors import SandboxError
from campugrid.protocol.spec import ENFORCED

SLOTS_ROOT = Path(os.environ.get("CAMPUGRID_SLOTS_DIR", "/var/lib/campugrid/slots"))
BALLAST, LOCK = ".ballast", ".lock"
KEEP = frozenset({BALLAST, LOCK, "lost+found"})
# Room for the folders' own blocks (directories, indirect blocks) on top of output_mb.
SLACK = 256 * 1024


@dataclasses.dataclass
class Slot:
    path: Path
    _lock_fd: int
    _start: int = 0  # free bytes when the task began

    def prepare(self, limit_bytes: int) -> Path:
        """Leave exactly `limit_bytes` (+ SLACK) free in the slot (emptied by the agent's
        sweep); the folder for the task's files. SandboxError if the slot cannot."""
        if self.leftovers():  # another job's files must never reach this one
            raise SandboxError(f"output slot {self.path} still holds "
                               f"{', '.join(p.name for p in self.leftovers())}")
        self._start = self._free()  # nothing of this task's yet
        self.resize(limit_bytes)
        folder = self.path / "task"
        folder.mkdir()
        return folder

    def resize(self, limit_bytes: int) -> None:
        """Bound the task's files to `limit_bytes` from now on, what they hold already
        included: the build's disk while it builds (its store in the task's folder), then
        /output's. SandboxError if the slot cannot hold that much."""
        used = self.used()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / BALLAST)
        free = self._free()
        ballast = free - max(0, limit_bytes - used) - SLACK
        if ballast < 0:
            raise SandboxError(f"{limit_bytes // 2**20} MB is more than output slot {self.path} "
                               f"holds ({max(0, free + used - SLACK) // 2**20} MB)")
        if ballast:
            fd = os.open(self.path / BALLAST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, ballast)
            finally:
                os.close(fd)
        self._start = self._free() + used

    def capacity(self) -> int:
        """The most a task may be given here: the slot's room without its ballast."""
        try:
            ballast = os.stat(self.path / BALLAST).st_blocks * 512
        except FileNotFoundError:
            ballast = 0
        return max(0, self._free() + ballast - SLACK)

    def used(self) -> int:
        """Bytes of disk the task's files hold now (blocks, as the filesystem counts them)."""
        return max(0, self._start - self._free())

    def leftovers(self) -> list[Path]:
        """Everything in the slot but its own files: what a sweep removes."""
        return [self.path / e for e in sorted(os.listdir(self.path)) if e not in KEEP]

    def _free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def remove_tree(path: Path) -> None:
    """rmtree, never through a link, and where a job left files owned by its user
    namespace's ids (which this user may not unlink from outside), the same from inside that
    namespace."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        subprocess.run(["podman", "unshare", "rm", "-rf", "--", str(path)], capture_output=True,
                       timeout=120, check=False)


def _visible_to_podman(path: Path) -> bool:
    """Is the slot mounted where Podman's containers are made (its rootless namespace)?"""
    try:
        return subprocess.run(["podman", "unshare", "mountpoint", "-q", str(path)],
                              capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def acquire(root: Path = SLOTS_ROOT) -> tuple[Slot | None, str]:
    """Take the first free slot for this process's lifetime: (slot, "enforced"), or (None,
    why none could be taken)."""
    if not root.is_dir():
        return None, (f"not enforced exactly: no output slots ({root} is missing; infra/setup.sh "
                      "makes them as root); /output is checked every 0.25 s")
    mounted = [p for p in sorted(root.iterdir(), key=lambda p: p.name)
               if p.is_dir() and os.path.ismount(p) and os.access(p, os.W_OK)]
    for path in mounted:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if not _visible_to_podman(path):
            os.close(fd)
            return None, (f"not enforced exactly: output slot {path} is not mounted in Podman's "
                          "rootless namespace (mounted after it started; `podman system "
                          "migrate` starts it afresh); /output is checked every 0.25 s")
        return Slot(path, fd), ENFORCED
    why = (f"all {len(mounted)} output slots under {root} are taken by other agents"
           if mounted else f"no output slot under {root} is mounted and writable by this user")
    return None, f"not enforced exactly: {why}; /output is checked every 0.25 s"
