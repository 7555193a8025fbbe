"""What a task's sandbox gets: the job's environment, its mounts (the hooks read-only; its
/output, /checkpoints and the checkpoint folder the spec names, writable and bounded), its
limits, the GPUs reserved for it, and how much its writable folders hold. The task (task.py)
decides when; this says what."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from campugrid import hooks
from campugrid.agent.messages import Gpu, Lease
from campugrid.hooks import autosave
from campugrid.protocol.spec import JobSpec
from campugrid.sandbox.runtime import RunRequest

HOOKS_MOUNT = "/opt/campugrid/hooks"
CHECKPOINT_MOUNT = "/checkpoints"
# The hooks, read-only, and their sitecustomize on the job's PYTHONPATH (every Python runs it).
HOOKS_MOUNTS = ((Path(hooks.__file__).parent, f"{HOOKS_MOUNT}/campugrid/hooks", "ro"),
                (Path(hooks.__file__).parent / "sitecustomize.py",
                 f"{HOOKS_MOUNT}/sitecustomize.py", "ro"))
Mapped = tuple[tuple[str, int], ...]  # (uuid, device minor) per reserved GPU


def job_env(spec: JobSpec, lease: Lease, image_env: Callable[[], Sequence[str] | None],
            resumed: int | None) -> dict[str, str]:
    """The spec's environment and the platform's: the job's own PYTHONPATH (the spec's, else
    its image's ENV, asked of the engine only then) first, then the hooks; what autosave
    needs (the epoch put back, the folder the spec names)."""
    user_pythonpath = dict(spec.env).get("PYTHONPATH") or next(
        (e.partition("=")[2] for e in image_env() or () if e.startswith("PYTHONPATH=")), None)
    taken = spec.checkpoints
    return dict(spec.env) | {
        "CAMPUGRID_JOB_ID": lease.job_id, "CAMPUGRID_ATTEMPT": str(lease.attempt),
        "CAMPUGRID_OUTPUT": "/output", "CAMPUGRID_CHECKPOINT_DIR": CHECKPOINT_MOUNT,
        "PYTHONPATH": f"{user_pythonpath}:{HOOKS_MOUNT}" if user_pythonpath else HOOKS_MOUNT,
    } | ({autosave.ENV_RESUMED: str(resumed)} if resumed is not None else {}) \
      | ({autosave.ENV_FROM: taken.dir, autosave.ENV_MATCH: taken.match} if taken else {})


def run_request(*, name: str, image: str, spec: JobSpec, lease: Lease, agent: str,
                files: Path | None, data_dir: Path | None, command: tuple[str, ...] | None,
                env: dict[str, str], mapped: Mapped) -> RunRequest:
    """The sandbox: the hooks (read-only), and with `files` (the task's folder of output,
    checkpoints and job-checkpoints, bounded by the disk watchdog) /output, /checkpoints and
    the spec's checkpoint folder, writable."""
    resources = spec.resources
    mounts: tuple[tuple[Path, str, str], ...] = HOOKS_MOUNTS
    output_dir = None
    if files is not None:
        output_dir, ckpt_dir, own_dir = folders(files)
        mounts = ((ckpt_dir, CHECKPOINT_MOUNT, "rw"), *HOOKS_MOUNTS, *(
            [(own_dir, spec.checkpoints.dir, "rw")] if spec.checkpoints else []))
    return RunRequest(
        name=name, image=image, command=command, env=tuple(env.items()), output_dir=output_dir,
        data_dir=data_dir if lease.datasets else None,
        memory_mb=resources.memory_mb, cpus=resources.cpus, tmp_mb=resources.disk_mb,
        wall_time_s=resources.wall_time_s, agent=agent, gpus=mapped,
        # One MB over: a single file can pass the limit only just, and the watchdog, which
        # stops the job once the folders hold more than output_mb, sees it.
        file_mb=resources.output_mb + 1 if files is not None else None, mounts=mounts)


def folders(files: Path) -> tuple[Path, Path, Path]:
    """/output, /checkpoints and the spec's checkpoint folder, in a task's folder of files."""
    return files / "output", files / "checkpoints", files / "job-checkpoints"


def bytes_in(paths: Sequence[Path]) -> int:
    """The apparent size of every file under `paths` (links not followed, sparse files at
    their full size: they would inflate the output tarball)."""
    total = 0
    for root in paths:
        for dirpath, _dirs, files in os.walk(root, followlinks=False):
            for f in files:
                with contextlib.suppress(OSError):  # removed meanwhile
                    total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def gpus_still_free(lease: Lease, found: Sequence[Gpu]) -> tuple[Mapped, str]:
    """The reserved GPUs as (uuid, minor), or why the reservation no longer fits."""
    by_uuid = {g.uuid: g for g in found}
    mapped = []
    for uuid in lease.gpu_uuids:
        g = by_uuid.get(uuid)
        if g is None:
            return (), f"reserved GPU {uuid} is no longer offered on this machine"
        if g.memory_free_mb < lease.gpu_memory_mb:
            return (), (f"reserved GPU {uuid} has only {g.memory_free_mb} MB free now, "
                        f"{lease.gpu_memory_mb} MB needed")
        mapped.append((uuid, g.minor))
    return tuple(mapped), ""
