"""A build's Python packages, fetched before it as binary wheels: RUN steps keep no network.

What to fetch is what the job declares (protocol/pipwords.py): the packages and requirement
files its Dockerfile's `pip install` lines name (read by the confined Dockerfile check; the
files are read here, from the unpacked context, as data), the local projects those lines
install (their pyproject.toml), the spec's `build.pip`, and what the uv.lock of a project a
`uv sync` line syncs pins (protocol/uvlock.py: exact pins, by the lock's hashes; the lock's
URLs are then pointed at the fetched copies). pip resolves and downloads them
here, outside any sandbox, as wheels only (`--only-binary=:all:`): a wheel is unpacked, never
run, so nothing from the job executes outside gVisor. pip checks each file against the
index's hash (and against any `--hash` a requirement file pins); the build log lists each
wheel with its size and sha256, and whether it came from pip's cache.

The build then sees the wheels read-only at IN_BUILD, and the agent's copy of the Dockerfile
declares `ARG PIP_NO_INDEX=1` and `ARG PIP_FIND_LINKS=...` after each FROM (lines added,
none changed: protocol.dockerfiles.pin_bases), so `pip install` in a RUN step installs from
them and from nothing else; build arguments do not stay in the image's environment. A
package only the build knows about finds no index, and the build fails: the agent names the
package and says how to declare it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import certifi
from packaging import tags

from campugrid.agent.messages import Mirror
from campugrid.protocol import uvlock
from campugrid.protocol.errors import BuildFailed, InvalidInput, SandboxError
from campugrid.protocol.pipwords import (
    PipInstall,
    locate,
    project_requirements,
    read_requirements,
    split_extras,
)
from campugrid.protocol.spec import BuildOptions
from campugrid.sandbox.process import LogFn, run_streaming

# Where RUN steps see the wheels. Buildah leaves a volume's mount point in the image (an empty
# folder); under /dev, which every runtime mounts afresh, no container of the image sees it.
IN_BUILD = "/dev/campugrid-wheels"
DEFAULT_PYTHON = "3.11"
DEFAULT_INDEX = "https://pypi.org/simple"
DOWNLOAD_TIMEOUT_S = 1800
# manylinux wheels up to this glibc (Debian bookworm has 2.36; 2.28 keeps to what most
# projects publish and what older bases still run).
GLIBC_MAX = 28
# The wheels pip chose for one set of requirements (the same index, Python and machine) are
# used again for this long without asking pip (1.2 s for NumPy and SciPy, warm): pip's own
# cache keeps PyPI's index pages 10 minutes, so it would choose the same. They are kept by
# sha256 beside the record and checked again when used.
RESOLVED_FRESH_S = 600
_SAVED = re.compile(r"^\s*(?:Saved|File was already downloaded) (\S+\.whl)$")


@dataclasses.dataclass(frozen=True)
class Staged:
    """The wheels of one build: `folder`, mounted at IN_BUILD, and pip's settings for RUN
    steps (build arguments: every RUN step of a stage sees them, the image does not keep
    them)."""

    folder: Path
    count: int
    bytes: int

    def volumes(self) -> tuple[tuple[Path, str], ...]:
        return ((self.folder, IN_BUILD),)

    def run_args(self) -> tuple[tuple[str, str], ...]:
        return (("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", IN_BUILD),
                ("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
                # uv (it reads no variable for --no-index): offline, the staged wheels as
                # its only candidates, `uv sync` from its lock (pointed at them), never a
                # Python download (a base without the project's Python fails saying so)
                ("UV_OFFLINE", "1"), ("UV_FIND_LINKS", IN_BUILD),
                ("UV_PYTHON_DOWNLOADS", "never"))


@dataclasses.dataclass(frozen=True)
class Declared:
    """Everything a build declares (`declared`)."""

    requirements: list[str]
    indexes: list[str]
    pre: bool
    warnings: list[str]
    locks: list[Path]  # uv.lock files that `uv sync` lines install from


def index_url(mirror: Mirror | None = None) -> tuple[str, str]:
    """Where this agent fetches wheels, and how to name it in the log (no token):
    CAMPUGRID_PIP_INDEX if set, else the platform's PyPI cache (from the lease), else PyPI."""
    if os.environ.get("CAMPUGRID_PIP_INDEX"):
        return os.environ["CAMPUGRID_PIP_INDEX"], os.environ["CAMPUGRID_PIP_INDEX"]
    if mirror is not None:
        return mirror.with_login() + "/index/", f"the platform's cache at {mirror.url}"
    return DEFAULT_INDEX, DEFAULT_INDEX


def python_of(env: Sequence[str] | None, build: BuildOptions) -> str:
    """The base's Python: the spec's build.python, else the image's PYTHON_VERSION (as the
    official python images set it), else DEFAULT_PYTHON."""
    if build.python:
        return build.python
    for item in env or ():
        name, _, value = item.partition("=")
        m = re.match(r"^(3\.\d{1,2})", value) if name == "PYTHON_VERSION" else None
        if m:
            return m[1]
    return DEFAULT_PYTHON


def declared(installs: Sequence[PipInstall], build: BuildOptions, context: Path) -> Declared:
    """Everything the build declares. Raises BuildFailed for a file the Dockerfile names that
    the context does not have."""
    reqs: list[str] = list(build.pip)
    indexes: list[str] = []
    pre = False
    warnings: list[str] = []
    locals_: list[tuple[str, int]] = []
    locks: list[Path] = []
    try:
        for use in installs:
            at = f"Dockerfile line {use.line}"
            reqs += use.requirements
            indexes += use.indexes
            pre = pre or use.pre
            locals_ += [(word, use.line) for word in use.local]
            for word in use.uv_projects:  # `uv sync`: its lock, else the project as pip's
                folder = locate(word if word not in (".", "..") else "", context, project=True)
                lock = uvlock.find(folder, context) if folder is not None else None
                if lock is None:
                    locals_.append((word, use.line))
                elif lock not in locks:
                    locks.append(lock)
            for name in use.files:
                found = locate(name, context)
                if found is None or not found.is_file():
                    raise BuildFailed(
                        f"{at}: pip install -r {name}: no such file in the context. The "
                        "agent reads requirement files before the build to fetch their "
                        "wheels: put it in the context (and COPY it), or list the packages "
                        "in the spec's build.pip", "")
                more, more_local, more_indexes, more_pre = read_requirements(found, context, at)
                reqs += more
                indexes += more_indexes
                pre = pre or more_pre
                locals_ += [(word, use.line) for word in more_local]
        for word, line in locals_:
            at = f"Dockerfile line {line}"
            path, extras = split_extras(word)
            if path.endswith((".whl", ".tar.gz", ".zip")):
                warnings.append(f"{at}: {path}: a file in the image; its dependencies are "
                                "not fetched unless build.pip lists them")
                continue
            # `cd /app && pip install .`: the line's own folder is unknown; the context's
            # folders that are projects are tried as locate says
            folder = locate(path if path not in (".", "..") else "", context, project=True)
            if folder is None:
                warnings.append(f"{at}: pip install {word}: no Python project (pyproject.toml, "
                                "setup.py) found for it in the context; list what it needs "
                                "in the spec's build.pip")
                continue
            more, warned = project_requirements(folder, extras, context, at)
            reqs += more
            warnings += warned
    except InvalidInput as e:
        raise BuildFailed(str(e), "") from e
    return Declared(list(dict.fromkeys(reqs)), list(dict.fromkeys(indexes)), pre, warnings,
                    locks)


def target_tags(python: str, arch: str) -> frozenset[tags.Tag]:
    """The wheel tags a CPython `python` on manylinux `arch` installs (what pip download is
    asked for below)."""
    version = tuple(int(part) for part in python.split(".")[:2])
    abi = f"cp{python.replace('.', '')}"
    return frozenset([*tags.cpython_tags(version, [abi], _platforms(arch)),
                      *tags.compatible_tags(version, abi, _platforms(arch))])


def _platforms(arch: str) -> list[str]:
    return [*[f"manylinux_2_{n}_{arch}" for n in range(GLIBC_MAX, 16, -1)],
            f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def _read_locks(paths: Sequence[Path], context: Path, python: str
                ) -> tuple[list[uvlock.Locked], list[str]]:
    """The declared uv.lock files, read for this platform, and what uv needs to build the
    local packages they install (their build-system.requires)."""
    locks, needs = [], []
    try:
        for path in paths:
            lock = uvlock.read(path, context, target_tags(python, platform.machine()),
                               "uv sync")
            for project in lock.projects:
                needs += project_requirements(project, (), context, "uv sync",
                                              depends=False)[0]
            locks.append(lock)
    except InvalidInput as e:
        raise BuildFailed(str(e), "") from e
    return locks, needs


def stage(installs: Sequence[PipInstall], build: BuildOptions, context: Path, work: Path, *,
          python: str, disk_mb: int, log: LogFn, stop: threading.Event | None,
          mirror: Mirror | None = None) -> Staged | None:
    """Fetch the declared wheels into `work`; None when the build installs nothing with pip.
    Raises BuildFailed for the job's faults (a package with no wheel, more than `disk_mb`),
    SandboxError when this machine cannot reach the index."""
    if not installs and not build.pip:
        return None
    found = declared(installs, build, context)
    locks, needs = _read_locks(found.locks, context, python)
    reqs = list(dict.fromkeys([*found.requirements, *needs]))
    for warning in found.warnings:
        log(f"[campugrid] {warning}")
    for lock in locks:
        for skipped in lock.skipped:
            log(f"[campugrid] {lock.path.relative_to(context.resolve())}: {skipped} has no "
                f"wheel for CPython {python} on manylinux {platform.machine()}; not fetched")
    folder = work / "wheels"

    def fetch(source: Mirror | None) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if reqs:
            _download(reqs, found.indexes, found.pre, python, folder, work, disk_mb, log, stop,
                      source)
        for lock in locks:  # exact pins, each checked against the lock's hashes
            for pins in lock.pins:
                _download(list(pins), list(lock.indexes), False, python, folder, work, disk_mb, log,
                          stop, source, pinned=lock.path.relative_to(context.resolve()))

    try:
        fetch(mirror)
    except SandboxError as e:
        if mirror is None or os.environ.get("CAMPUGRID_PIP_INDEX"):
            raise
        # The platform's cache is out of this machine's reach (a coordinator that serves
        # REST on its own loopback only): the index itself, then.
        log(f"[campugrid] {e.reason}; fetching from {DEFAULT_INDEX} instead")
        fetch(None)
    _trim_cache(log)
    wheels = sorted(folder.glob("*.whl"))
    for lock in locks:  # `uv sync` installs the copies, pins and hashes as locked
        text = lock.path.read_text()
        pointed = uvlock.pointed(text, lock.urls, [w.name for w in wheels], IN_BUILD)
        swap = lock.path.with_name(f".{lock.path.name}.campugrid")
        swap.write_text(pointed)
        swap.replace(lock.path)  # a new file: a link in the context keeps what it had
        log(f"[campugrid] {lock.path.relative_to(context.resolve())}: its wheel URLs point at "
            f"the fetched copies in {IN_BUILD} for the build (pins and hashes unchanged)")
    total = 0
    for wheel in wheels:
        size = wheel.stat().st_size
        total += size
        log(f"[campugrid] wheel {wheel.name} {size / 1024**2:.1f} MB sha256:{_sha256(wheel)}")
    named = [*reqs, *[str(lock.path.relative_to(context.resolve())) for lock in locks]]
    log(f"[campugrid] staged {len(wheels)} wheels, {total / 1024**2:.1f} MB, for CPython "
        f"{python} ({', '.join(named) or 'nothing declared'}); RUN steps install from them "
        "offline")
    if total > disk_mb * 1024**2:
        raise BuildFailed(f"the build's Python wheels take {total // 1024**2} MB, more than "
                          f"resources.disk_mb ({disk_mb} MB)", "")
    return Staged(folder, len(wheels), total)


def _download(reqs: list[str], indexes: list[str], pre: bool, python: str, folder: Path,
              work: Path, disk_mb: int, log: LogFn, stop: threading.Event | None,
              mirror: Mirror | None, pinned: Path | None = None) -> None:
    """pip download, stopped as soon as what it has written (the wheels and its own
    temporary files) passes `disk_mb`. `pinned`: the lock `reqs` come from (exact pins with
    hashes; their dependencies are pinned too, so none is resolved)."""
    listed = work / "wheels-requirements.txt"
    scratch = work / "pip-tmp"
    scratch.mkdir(exist_ok=True)
    listed.write_text("".join(f"{r}\n" for r in reqs))  # checked requirement lines only
    arch = platform.machine()
    tag = python.replace(".", "")
    index, shown = index_url(mirror)
    trust = []
    if mirror is not None and mirror.certificate and index.startswith(mirror.with_login()):
        bundle = work / "pip-ca.pem"  # the usual roots, and the coordinator's own certificate
        bundle.write_text(Path(certifi.where()).read_text() + "\n" + mirror.certificate)
        trust = ["--cert", str(bundle)]
    argv = ["env", f"TMPDIR={scratch}", sys.executable, "-m", "pip", "download", "--isolated",
            "--no-input",
            "--disable-pip-version-check", "--progress-bar", "off",
            "--only-binary=:all:", "--dest", str(folder),
            "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}",
            *[a for p in _platforms(arch) for a in ("--platform", p)],
            "--index-url", index, *trust,
            *[a for url in indexes for a in ("--extra-index-url", url)],
            *(["--pre"] if pre else []), *(["--no-deps"] if pinned else []),
            "-r", str(listed)]
    key = hashlib.sha256(json.dumps([reqs, indexes, pre, python, arch, shown,
                                     pinned is not None]).encode()).hexdigest()
    if _reuse(key, folder, ", ".join([shown, *indexes]), log):
        return
    log(f"[campugrid] fetching Python wheels{f' that {pinned} pins' if pinned else ''} for "
        f"CPython {python} on {arch} from {', '.join([shown, *indexes])}")
    halt, too_big = threading.Event(), threading.Event()
    saved: list[str] = []

    def said(line: str) -> None:
        if (m := _SAVED.match(line)) and Path(m[1]).parent == folder:
            saved.append(Path(m[1]).name)
        log(f"[pip] {line}")

    def watch() -> None:
        while not halt.wait(0.5):
            if stop is not None and stop.is_set():
                halt.set()
            elif _size(folder) + _size(scratch) > disk_mb * 1024**2:
                too_big.set()
                halt.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = run_streaming(argv, log=said, timeout_s=DOWNLOAD_TIMEOUT_S, cancel=halt,
                             tail_lines=60)
    finally:
        halt.set()
        watcher.join()
        shutil.rmtree(scratch, ignore_errors=True)
    if too_big.is_set():
        raise BuildFailed(f"the build's Python wheels take more than resources.disk_mb "
                          f"({disk_mb} MB); stopped fetching them", done.tail[-2000:])
    if done.cancelled:
        raise BuildFailed("stopped while fetching Python wheels", "")
    if done.returncode == 0 and not done.timed_out:
        _remember(key, folder, saved)
        return
    tail = done.tail
    if "DO NOT MATCH THE HASHES" in tail:
        raise BuildFailed(f"a Python wheel's sha256 differs from the one "
                          f"{pinned or 'a requirement file'} names: refused (see the build "
                          "log)", tail[-2000:])
    if done.timed_out or re.search(r"NewConnectionError|ConnectTimeout|Max retries exceeded|"
                                   r"Temporary failure in name resolution|ProxyError", tail):
        raise SandboxError(f"cannot fetch Python wheels from {shown} (this machine's "
                           "network)")
    missing = re.findall(r"No matching distribution found for (\S+)", tail)
    if missing:
        raise BuildFailed(
            f"Python package {', '.join(dict.fromkeys(missing))}: no binary wheel for CPython "
            f"{python} on manylinux {arch}. Builds install wheels only (nothing from a job is "
            "built outside the sandbox): pick a version that publishes a wheel, set "
            "build.python if the base has another Python, or put the wheel into the context "
            "and install it from there", tail[-2000:])
    raise BuildFailed("fetching the build's Python wheels failed (see the build log)",
                      tail[-2000:])


def explain(failure: BuildFailed, staged: Staged | None) -> BuildFailed:
    """A build that failed because a RUN step's pip found no wheel for a package: say which,
    and how to declare it."""
    tail = failure.log_tail
    locked = re.findall(r"Failed to download `([^`]+)`", tail)  # uv sync, from its lock
    if locked:
        return BuildFailed(
            f"`uv sync` needs {', '.join(dict.fromkeys(locked))} from uv.lock, which was not "
            "fetched: it has no wheel for this base's Python and platform (the build log "
            "lists what was skipped), and nothing is built outside the sandbox. Lock a "
            f"version that publishes one, or set build.python. ({failure.reason})", tail)
    found = re.findall(r"No matching distribution found for (\S+)", tail) \
        + re.findall(r"Because (\S+) was not found in the cache", tail)  # uv, offline
    if not found:
        return failure
    names = ", ".join(dict.fromkeys(found))
    where = "was not declared" if staged is not None else "cannot be fetched: this build " \
        "declared no Python packages"
    return BuildFailed(
        f"a RUN step installs {names}, which {where}; RUN steps have no network and install "
        "only the wheels fetched before the build. Declare it: name it on a `pip install` "
        "line or in a requirements file that such a line names, or list it in the spec's "
        f"build.pip. ({failure.reason})", failure.log_tail)


def _resolved() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "campugrid" / "wheels"


def _reuse(key: str, folder: Path, source: str, log: LogFn) -> bool:
    """Into `folder`, the wheels pip chose for `key` less than RESOLVED_FRESH_S ago; False,
    with nothing left behind, when there are none or a kept one changed."""
    store = _resolved()
    record = store / "sets" / f"{key}.json"
    try:
        age = time.time() - record.stat().st_mtime
        chosen = [(str(name), str(digest)) for name, digest in json.loads(record.read_text())]
    except (OSError, ValueError, TypeError):
        return False
    if not 0 <= age < RESOLVED_FRESH_S or not chosen:
        return False
    placed: list[Path] = []
    for name, digest in chosen:
        target = folder / Path(name).name
        if target.exists():  # another requirement set of this build chose it too
            continue
        try:
            _place(store / "files" / digest, target)
            placed.append(target)
            if _sha256(target) != digest:
                (store / "files" / digest).unlink()
                raise OSError(f"{name} changed in this machine's cache")
        except OSError:
            for path in placed:
                path.unlink(missing_ok=True)
            record.unlink(missing_ok=True)
            return False
    log(f"[campugrid] {len(chosen)} Python wheels as pip chose them {age:.0f} s ago for the "
        f"same requirements from {source}, kept on this machine (pip is asked again after "
        f"{RESOLVED_FRESH_S // 60} minutes)")
    return True


def _remember(key: str, folder: Path, names: list[str]) -> None:
    """What pip chose for `key`, for _reuse: the wheels by sha256, and a record naming them."""
    if not names:
        return
    store = _resolved()
    with contextlib.suppress(OSError):
        (store / "files").mkdir(parents=True, exist_ok=True)
        (store / "sets").mkdir(exist_ok=True)
        chosen = []
        for name in dict.fromkeys(names):
            digest = _sha256(folder / name)
            if not (store / "files" / digest).exists():
                _place(folder / name, store / "files" / digest)
            chosen.append([name, digest])
        record = store / "sets" / f"{key}.json"
        partial = record.with_suffix(".partial")
        partial.write_text(json.dumps(chosen))
        partial.replace(record)


def _place(source: Path, target: Path) -> None:
    """A hard link where it can be (same filesystem), else a copy, made whole or not at all."""
    try:
        os.link(source, target)
    except OSError:
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(source, partial)
        partial.replace(target)


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # pip renames and removes as this walks
            total += path.lstat().st_size
    return total


def _trim_cache(log: LogFn) -> None:
    """pip's cache (this user's, shared by all builds here) stays under CAMPUGRID_PIP_CACHE_MB
    (default 2048): past it, it is emptied."""
    limit = int(os.environ.get("CAMPUGRID_PIP_CACHE_MB") or 2048)
    for cache, what in ((Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip"),
                         "pip's cache"), (_resolved(), "the cache of the wheels pip chose")):
        if cache.is_dir() and _size(cache) > limit * 1024**2:
            shutil.rmtree(cache, ignore_errors=True)
            log(f"[campugrid] {what} passed {limit} MB and was emptied")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
