"""Checkpoints from training code that never heard of campugrid. The hooks' sitecustomize runs
`start()` in every Python process of a job (the hooks folder is on the job's PYTHONPATH):

- **Put back.** On a resumed attempt the agent unpacks the checkpoint it resumes from into
  $CAMPUGRID_CHECKPOINT_DIR and names its epoch in $CAMPUGRID_RESUMED_EPOCH. A checkpoint taken
  from a framework's folder goes back into that folder, under its own name, before the job's
  code looks there, so the framework's own resume logic finds it.
- **Watch.** The folder a job names (`"checkpoints": {"dir": ..., "match": ...}`, passed as
  $CAMPUGRID_CHECKPOINTS_FROM and $CAMPUGRID_CHECKPOINTS_MATCH): each entry whose name matches
  and holds a step number becomes a checkpoint once its files have stopped changing or a newer
  one began, and when the process ends (at SIGTERM: what did not change since the last look).
- **Frameworks** (frameworks.py, which sitecustomize installs once `start()` says this is a
  job): when Hugging Face transformers, PyTorch Lightning or Keras is imported, its checkpoint
  is taken the moment it is written, the one put back is handed to its resume logic, and
  SIGTERM (a drain) becomes "save now, then stop".

A taken checkpoint is an ordinary `epoch-N` folder (N: the step in the name) holding the entry
under its own name, its manifest's meta saying where it came from: the agent uploads it as it
uploads any, and the coordinator checks it the same way. Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import fnmatch
import os
import re
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from campugrid import hooks

ENV_FROM = "CAMPUGRID_CHECKPOINTS_FROM"
ENV_MATCH = "CAMPUGRID_CHECKPOINTS_MATCH"
ENV_RESUMED = "CAMPUGRID_RESUMED_EPOCH"
SETTLE_S = 2.0  # an entry whose files did not change for this long is complete
EVERY_S = 1.0
LOCK = ".autosave.lock"  # in the checkpoint folder: one watcher per job, whichever Python
_STEP = (re.compile(r"step[=_-]?([0-9]{1,15})", re.IGNORECASE), re.compile(r"([0-9]{1,15})"))

_lock = threading.Lock()
_newest = -1  # the newest step taken (or put back) by this process
_started = False
# A framework's hook takes its checkpoints the moment they are complete: from then on the
# folder watch, which can only guess when an entry is complete, takes nothing.
_framework: str | None = None


def say(text: str) -> None:
    """One line in the job's log."""
    print(f"[campugrid] {text}", file=sys.stderr, flush=True)


def step_of(name: str) -> int | None:
    """The step (or epoch) a checkpoint's name holds: `step=N` where it says so (Lightning's
    `epoch=2-step=300.ckpt`), else its last number (`checkpoint-500`, `model_0012.pt`)."""
    found = _STEP[0].findall(name) or _STEP[1].findall(name)
    return int(found[-1]) if found else None


def take(step: int, source: Path, framework: str) -> bool:
    """Checkpoint `source` (a file or a folder, its links left out) as epoch `step`, unless a
    newer one was taken already. Returns whether it was taken."""
    global _newest
    with _lock:
        if step <= _newest:
            return False
        meta = {"folder": str(source.parent.absolute()), "entry": source.name,
                "framework": framework}
        try:
            with hooks.save(step, meta=meta) as into:
                _copy(source, into / source.name)
        except (OSError, hooks.CheckpointError) as e:
            say(f"checkpoint {source} was not taken: {e}")
            return False
        _newest = step
        return True


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
    """A framework's hook is active in this job: its saves are the checkpoints."""
    global _framework
    if _framework is None:
        say(f"checkpoints: {name}'s own, taken as it saves them")
    _framework = name


def put_back() -> Path | None:
    """The checkpoint this attempt resumes from, back where its framework wrote it (if it was
    taken from one and is not there already). Returns that place."""
    global _newest
    wanted = os.environ.get(ENV_RESUMED, "")
    if not wanted.isdigit():
        return None
    resumed = hooks.checkpoint_dir() / hooks.folder_name(int(wanted))
    try:
        manifest = hooks.verify(resumed)
    except (hooks.CheckpointError, OSError):
        return None
    meta = manifest.get("meta") or {}
    folder, entry = meta.get("folder"), meta.get("entry")
    if not isinstance(folder, str) or not isinstance(entry, str) or "/" in entry:
        return None  # saved with campugrid.hooks: the job restores it itself
    with _lock:
        _newest = max(_newest, int(wanted))
    target = Path(folder) / entry
    if not target.exists():
        Path(folder).mkdir(parents=True, exist_ok=True)
        _copy(resumed / entry, target)
        say(f"put the checkpoint of step {wanted} back at {target}")
    return target


def resumed_entry(framework: str) -> Path | None:
    """Where the checkpoint this attempt resumes from was put back, if `framework` made it."""
    wanted = os.environ.get(ENV_RESUMED, "")
    if not wanted.isdigit():
        return None
    with contextlib.suppress(hooks.CheckpointError, OSError):
        meta = hooks.verify(hooks.checkpoint_dir() / hooks.folder_name(int(wanted))).get("meta")
        if isinstance(meta, dict) and meta.get("framework") == framework:
            return Path(str(meta["folder"])) / str(meta["entry"])
    return None


class Watch:
    """A folder's matching entries, taken once settled."""

    def __init__(self, folder: Path, match: str = "*", settle_s: float = SETTLE_S) -> None:
        self.folder, self.match, self.settle_s = folder, match or "*", settle_s
        self.seen: dict[str, tuple[tuple[Any, ...], float]] = {}
        self.unnamed: set[str] = set()

    def scan(self, final: bool = False, settle_s: float | None = None) -> None:
        """Take what has settled (unchanged for `settle_s`, or superseded by a newer one);
        `final`: the job's code has ended, whatever is there is complete."""
        settle_s = self.settle_s if settle_s is None else settle_s
        if _framework is not None:
            return
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError:
            return
        candidates = []
        for entry in entries:
            if entry.is_symlink() or not fnmatch.fnmatch(entry.name, self.match):
                continue
            step = step_of(entry.name)
            if step is None:
                if entry.name not in self.unnamed:
                    self.unnamed.add(entry.name)
                    say(f"{self.folder}/{entry.name}: no step number in its name; not taken")
                continue
            if step > _newest:
                candidates.append((step, Path(entry.path)))
        now = time.monotonic()
        candidates.sort()
        if len(candidates) > 1 and not final:
            # The job has begun a newer one: the one before is complete. Only the newest of
            # them matters (an older step is never taken after a newer one).
            take(*candidates[-2], "folder")
            candidates = candidates[-1:]
        for step, path in candidates:
            mark = _fingerprint(path)
            before = self.seen.get(path.name)
            if before is None or before[0] != mark:
                self.seen[path.name] = (mark, now)
                if not final:
                    continue
            elif not final and now - before[1] < settle_s:
                continue
            if take(step, path, "folder"):
                self.seen.pop(path.name, None)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(EVERY_S):
            try:
                self.scan()
            except Exception as e:  # a job's folder is its own business: never crash it
                say(f"watching {self.folder}: {e}")


def _fingerprint(path: Path) -> tuple[Any, ...]:
    """What changes while an entry is being written: its files, their sizes and times."""
    try:
        if not path.is_dir():
            st = os.lstat(path)
            return ((path.name, st.st_size, st.st_mtime_ns),)
        return tuple((str(p.relative_to(path)), p.lstat().st_size, p.lstat().st_mtime_ns)
                     for p in hooks.regular_files(path))
    except OSError:
        return (time.monotonic(),)  # vanished or changing: never equal to the last look


def _watch_this_job() -> bool:
    """One watcher per job: whichever Python holds the lock (released when it exits)."""
    try:
        fd = os.open(hooks.checkpoint_dir() / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True  # the descriptor stays open, and the lock held, for the process's life


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
    if folder and _watch_this_job():
        watch = Watch(Path(folder), os.environ.get(ENV_MATCH, "*"))
        stop = threading.Event()
        thread = threading.Thread(target=watch.run, args=(stop,), name="campugrid-watch",
                                  daemon=True)
        thread.start()

        def last_look() -> None:  # the job's code has ended: what it wrote is complete
            stop.set()
            watch.scan(final=True)

        atexit.register(last_look)
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_sigterm(signum: int, frame: Any) -> None:
                # A drain: take what did not change since the last look (a file being written
                # now is not complete), then end as SIGTERM would have.
                stop.set()
                watch.scan(settle_s=0.0)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, on_sigterm)
    return True
