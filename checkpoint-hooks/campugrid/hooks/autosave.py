"""Checkpoints from training code that never heard of campugrid. The hooks' sitecustomize runs
`start()` in every Python process of a job (the hooks folder is on the job's PYTHONPATH):

- **Put back.** On a resumed attempt the agent unpacks the checkpoint it resumes from into
  $CAMPUGRID_CHECKPOINT_DIR and names its epoch in $CAMPUGRID_RESUMED_EPOCH. A checkpoint taken
  from a framework's folder goes back into that folder, under its own name, before the job's
  code looks there, so the framework's own resume logic finds it.
- **Watch.** The folder a job names (`"checkpoints": {"dir": ..., "match": ...}`, passed as
  $CAMPUGRID_CHECKPOINTS_FROM and $CAMPUGRID_CHECKPOINTS_MATCH): the entries whose names match
  and hold the same step number (`model_00100.pt`, `optim_00100.pt`) become one checkpoint once
  their files stopped changing for SETTLE_S, or, unchanged since the last look, once a newer
  step began or the process ends (at exit two looks apart, and not the newest after an
  uncaught exception; at SIGTERM what the last look saw). Empty entries are never taken.
- **Frameworks** (frameworks.py, which sitecustomize installs once `start()` says this is a
  job): when Hugging Face transformers, PyTorch Lightning or Keras is imported, its checkpoint
  is taken the moment it is written, the one put back is handed to its resume logic, and
  SIGTERM (a drain) becomes "save now, then stop".

A taken checkpoint is an ordinary `epoch-N` folder (N: the step in the name) holding the
entries under their own names, its manifest's meta saying where they came from: the agent
uploads it as it uploads any, and the coordinator checks it the same way. What several Pythons
of one job share (a launcher and its ranks, a process and its spawned workers) is kept in the
checkpoint folder under one lock: what was taken (an `epoch-N` is never replaced), whether a
framework took over, and which process watches. Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import fnmatch
import json
import os
import re
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from campugrid import hooks

ENV_FROM = "CAMPUGRID_CHECKPOINTS_FROM"
ENV_MATCH = "CAMPUGRID_CHECKPOINTS_MATCH"
ENV_RESUMED = "CAMPUGRID_RESUMED_EPOCH"
ENV_PUT_BACK = "CAMPUGRID_PUT_BACK"  # set once done: the job's later Pythons skip it
SETTLE_S = 2.0  # an entry whose files did not change for this long is complete
EVERY_S = 1.0
LOCK = ".autosave.lock"  # in the checkpoint folder: what is taken, and put back, one at a time
WATCHER = ".autosave.watcher"  # held by the Python that watches the folder
FRAMEWORK = ".autosave.framework"  # a framework's hook took over (its name)
DRAINED = 128 + signal.SIGTERM  # the exit status of a job stopped by a drain
_STEP = (re.compile(r"step[=_-]?([0-9]{1,15})", re.IGNORECASE), re.compile(r"([0-9]{1,15})"))

_lock = threading.Lock()
_started = False
_held: set[str] = set()  # the lock files of the checkpoint folder this process holds
_crashed = False  # an uncaught exception is ending this process


def say(text: str) -> None:
    """One line in the job's log."""
    print(f"[campugrid] {text}", file=sys.stderr, flush=True)


def step_of(name: str) -> int | None:
    """The step (or epoch) a checkpoint's name holds: `step=N` where it says so (Lightning's
    `epoch=2-step=300.ckpt`), else its last number (`checkpoint-500`, `model_0012.pt`)."""
    found = _STEP[0].findall(name) or _STEP[1].findall(name)
    return int(found[-1]) if found else None


@contextlib.contextmanager
def _job_lock() -> Iterator[None]:
    """This job's lock, across its Pythons (and this process's threads)."""
    with _lock:
        fd = os.open(hooks.checkpoint_dir() / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def newest() -> int:
    """The newest step taken in this job (by any of its Pythons), or put back; -1: none."""
    resumed = os.environ.get(ENV_RESUMED, "")
    done = [int(p.name[len(hooks.PREFIX):]) for p in hooks.complete()]
    return max([*done, int(resumed) if resumed.isdigit() else -1])


def take(step: int, sources: list[Path], framework: str) -> bool:
    """Checkpoint `sources` (files or folders of one folder, their links left out) as epoch
    `step`, unless this step or a newer one was taken already. Returns whether it was."""
    try:
        with _job_lock():
            if step <= newest():
                return False
            meta = {"folder": str(sources[0].parent.absolute()),
                    "entries": [p.name for p in sources], "framework": framework}
            with hooks.save(step, meta=meta) as into:
                for source in sources:
                    _copy(source, into / source.name)
            return True
    except (OSError, hooks.CheckpointError) as e:  # the job trains on; the next one may do
        say(f"checkpoint {', '.join(map(str, sources))} was not taken: {e}")
        return False


def _copy(source: Path, target: Path) -> None:
    """Regular files only, never following a link (what a checkpoint may hold)."""
    if stat.S_ISREG(os.lstat(source).st_mode):
        shutil.copyfile(source, target, follow_symlinks=False)
        return
    for path in hooks.regular_files(source):
        into = target / path.relative_to(source)
        into.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, into, follow_symlinks=False)


def framework_takes_over(name: str) -> None:
    """A framework's hook is active in this job: its saves are the checkpoints, and the folder
    watch (in whichever Python of the job it runs) takes nothing more."""
    try:
        marker = hooks.checkpoint_dir() / FRAMEWORK
        if not marker.exists():
            marker.write_text(name)
            say(f"checkpoints: {name}'s own, taken as it saves them")
    except OSError as e:  # no checkpoint folder to write to: nothing to take either
        say(f"checkpoints: {name}'s own cannot be taken here ({e})")


def _resumed_meta() -> tuple[int, Path, dict[str, Any]] | None:
    """The checkpoint this attempt resumes from, if autosave took it: (step, its folder, its
    manifest's meta). The agent checked it against its manifest when it unpacked it."""
    wanted = os.environ.get(ENV_RESUMED, "")
    if not wanted.isdigit():
        return None
    folder = hooks.checkpoint_dir() / hooks.folder_name(int(wanted))
    try:
        meta = json.loads((folder / hooks.MANIFEST).read_text()).get("meta")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(meta, dict):
        return None
    entries = meta.get("entries")
    if (not isinstance(meta.get("folder"), str) or not isinstance(entries, list) or not entries
            or not all(isinstance(e, str) and e and "/" not in e and e not in (".", "..")
                       for e in entries)):
        return None  # saved with campugrid.hooks: the job restores it itself
    return int(wanted), folder, meta


def put_back() -> list[Path]:
    """The checkpoint this attempt resumes from, back where the job's code wrote it (each
    entry not there already, copied under a temporary name and renamed). Once per attempt:
    the job's later Pythons are told by the environment."""
    found = None if os.environ.get(ENV_PUT_BACK) else _resumed_meta()
    if found is None:
        return []
    step, source, meta = found
    folder = Path(meta["folder"])
    targets = [folder / e for e in meta["entries"]]
    with _job_lock():
        for target in targets:
            if target.exists() or target.is_symlink():
                continue
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".campugrid-{target.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            _copy(source / target.name, partial)
            os.replace(partial, target)
        say(f"put the checkpoint of step {step} back at {', '.join(map(str, targets))}")
    os.environ[ENV_PUT_BACK] = str(step)
    return targets


def resumed_entry(framework: str) -> Path | None:
    """Where the checkpoint this attempt resumes from was put back, if `framework` made it."""
    found = _resumed_meta()
    if found is None or found[2].get("framework") != framework:
        return None
    return Path(str(found[2]["folder"])) / str(found[2]["entries"][0])


class Watch:
    """A folder's matching entries, taken once complete (by the rules in this module's
    docstring)."""

    def __init__(self, folder: Path, match: str = "*", settle_s: float = SETTLE_S) -> None:
        self.folder, self.match, self.settle_s = folder, match or "*", settle_s
        self.seen: dict[int, tuple[tuple[Any, ...], float]] = {}  # step: (fingerprint, since)
        self.unnamed: set[str] = set()

    def scan(self, ending: bool = False, clean: bool = True) -> None:
        """Take what is complete; `ending`: the process ends, so whatever did not change since
        the last look is, the newest step too unless the process ends unclean (an uncaught
        exception may have cut a save short)."""
        if (hooks.checkpoint_dir() / FRAMEWORK).exists():
            return
        steps: dict[int, list[Path]] = {}
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.is_symlink() or not fnmatch.fnmatch(entry.name, self.match):
                continue
            step = step_of(entry.name)
            if step is None:
                if entry.name not in self.unnamed:
                    self.unnamed.add(entry.name)
                    say(f"{self.folder}/{entry.name}: no step number in its name; not taken")
                continue
            steps.setdefault(step, []).append(Path(entry.path))
        done = newest()
        pending = sorted(s for s in steps if s > done)
        now = time.monotonic()
        for step in pending:
            mark = _fingerprint(steps[step])
            before = self.seen.get(step)
            self.seen[step] = (mark, before[1] if before and before[0] == mark else now)
            if before is None or before[0] != mark or not mark:
                continue  # first seen, changed since, or empty: not complete yet
            superseded = step != pending[-1]
            if superseded or (ending and clean) or now - before[1] >= self.settle_s:
                take(step, steps[step], "folder")

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(EVERY_S):
            try:
                if _hold(WATCHER):
                    self.scan()
            except Exception as e:  # a job's folder is its own business: never crash it
                say(f"watching {self.folder}: {e}")


def _fingerprint(paths: list[Path]) -> tuple[Any, ...]:
    """What changes while entries are being written: their files, sizes and times (empty:
    nothing in them yet)."""
    out: list[Any] = []
    try:
        for path in paths:
            if not path.is_dir():
                st = os.lstat(path)
                out.append((path.name, st.st_size, st.st_mtime_ns))
            else:
                out += [(str(p.relative_to(path.parent)), p.lstat().st_size, p.lstat().st_mtime_ns)
                        for p in hooks.regular_files(path)]
    except OSError:
        return (time.monotonic(),)  # vanished or changing: never equal to the last look
    return tuple(out)


def _hold(name: str) -> bool:
    """Hold the lock file `name` of the checkpoint folder for the rest of this process's life
    (one Python of the job watches; when it ends, another's watcher takes over)."""
    if name in _held:
        return True
    try:
        fd = os.open(hooks.checkpoint_dir() / name, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held.add(name)  # the descriptor stays open
    return True


def start() -> bool:
    """In every Python of a campugrid job: put back, watch the folder (sitecustomize then
    hooks the frameworks). False outside a job (a build step, a shell on a workstation)."""
    global _started
    if _started or not os.environ.get(hooks.ENV_DIR):
        return False
    _started = True
    try:
        put_back()
    except OSError as e:
        say(f"the checkpoint this attempt resumes from could not be put back: {e}")
    folder = os.environ.get(ENV_FROM)
    if not folder:
        return True
    watch = Watch(Path(folder), os.environ.get(ENV_MATCH, "*"))
    stop = threading.Event()
    threading.Thread(target=watch.run, args=(stop,), name="campugrid-watch", daemon=True).start()

    def at_exit() -> None:
        stop.set()
        if _hold(WATCHER):  # this process watched, or no other does now
            watch.scan()  # a look at what it wrote last, then, nothing writing any more:
            time.sleep(0.2)
            watch.scan(ending=True, clean=not _crashed)

    previous = sys.excepthook

    def excepthook(*args: Any) -> None:
        global _crashed
        _crashed = True
        previous(*args)

    sys.excepthook = excepthook
    atexit.register(at_exit)
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def on_sigterm(signum: int, frame: Any) -> None:
            # A drain: take what did not change since the last look (not what is being written
            # now), then end as a drained job ends (exiting: SIGTERM's default does nothing
            # to a sandbox's first process).
            stop.set()
            if _hold(WATCHER):
                watch.scan(ending=True)
            os._exit(DRAINED)

        signal.signal(signal.SIGTERM, on_sigterm)
    return True
