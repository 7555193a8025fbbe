"""A uv project's lock (uv.lock), read as data so that `uv sync --locked` builds offline.

`uv sync` installs exactly what uv.lock pins, and downloads each wheel from the URL the lock
names (with `--frozen` it reads no index configuration at all), so a RUN step with no network
cannot sync. The agent fetches the locked wheels beforehand, checked against the lock's own
hashes, and points the lock's wheel URLs at the fetched copies (`file:///dev/campugrid-wheels/
...`): every pin and hash stays as the researcher locked it, and `uv sync`, `--locked` and
`--frozen` install from those copies. What uv would fetch from elsewhere (version control, a
plain URL) is refused with the package named.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.pipwords import MAX_REQUIREMENTS, check_index, requirement

LOCK = "uv.lock"
MAX_LOCK_BYTES = 8 * 1024**2  # read in the agent's own process: a large ML project's is ~2 MiB
PYPI = "https://pypi.org/simple"
# Where a package comes from when uv builds it here, from the context: fine offline.
_LOCAL = ("editable", "directory", "path", "virtual")


@dataclasses.dataclass(frozen=True)
class Locked:
    """What one uv.lock needs fetched for a target platform."""

    path: Path
    pins: tuple[tuple[str, ...], ...]  # rounds of "name==version --hash=…" (one per version)
    indexes: tuple[str, ...]  # index URLs other than PyPI that the lock names
    urls: dict[str, str]  # wheel file name -> the URL the lock downloads it from
    projects: tuple[Path, ...]  # local packages uv builds (their folders, in the context)
    skipped: tuple[str, ...]  # "name version": no wheel for the target (uv skips it by marker,
    # or the build fails naming it)


def find(project: Path, root: Path) -> Path | None:
    """The lock of the project in `project`: its own, or its workspace's above it (within the
    context)."""
    root = root.resolve()
    here = project.resolve()
    while here.is_relative_to(root):
        lock = here / LOCK
        if lock.is_file() and lock.resolve().is_relative_to(root):  # no link out of it
            return lock
        if here == root:
            break
        here = here.parent
    return None


def read(path: Path, root: Path, supported: Collection[Tag], at: str) -> Locked:
    """The wheels `path` (a uv.lock in the context) pins for a platform whose wheel tags are
    `supported`. Raises InvalidInput for a lock that cannot work offline."""
    where = f"{at}: {path.relative_to(root.resolve())}"
    if path.stat().st_size > MAX_LOCK_BYTES:
        raise InvalidInput(f"{where}: larger than {MAX_LOCK_BYTES // 1024**2} MiB")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InvalidInput(f"{where} is not a lock uv wrote ({e})") from e
    packages = data.get("package")
    if not isinstance(packages, list):
        raise InvalidInput(f"{where}: no [[package]] entries; run `uv lock` and add it again")
    if len(packages) > MAX_REQUIREMENTS:
        raise InvalidInput(f"{where}: more than {MAX_REQUIREMENTS} packages")
    versions: dict[str, list[str]] = {}
    indexes: list[str] = []
    urls: dict[str, str] = {}
    projects: list[Path] = []
    skipped: list[str] = []
    for entry in packages:
        if not isinstance(entry, dict):
            raise InvalidInput(f"{where}: a [[package]] entry is not a table")
        name, version = str(entry.get("name", "")), str(entry.get("version", ""))
        source = entry.get("source")
        kind, value = next(iter(source.items())) if isinstance(source, dict) and source \
            else ("", "")
        label = f"{where}: package {name} {version}".rstrip()
        if kind in _LOCAL:
            folder = (path.parent / str(value)).resolve()
            if not folder.is_relative_to(root.resolve()):
                raise InvalidInput(f"{label}: {value} lies outside the context")
            if kind != "virtual" and folder.is_dir():
                projects.append(folder)
            continue
        if kind != "registry":
            raise InvalidInput(f"{label} comes from {kind or 'nowhere'} {value}: an offline "
                               "build fetches only from package indexes; lock it from one, or "
                               "put it into the context and lock it as a path")
        registry = str(value)
        if "://" not in registry:  # a folder of wheels in the project: already offline
            continue
        if registry.rstrip("/") != PYPI:
            indexes.append(check_index(registry, label))
        pin = _pin(entry, name, version, supported, urls, label)
        if pin is None:
            skipped.append(f"{name} {version}")
        else:
            versions.setdefault(canonicalize_name(name), []).append(pin)
    rounds = max((len(v) for v in versions.values()), default=0)
    pins = tuple(tuple(v[n] for v in versions.values() if n < len(v)) for n in range(rounds))
    return Locked(path, pins, tuple(dict.fromkeys(indexes)), urls, tuple(projects),
                  tuple(skipped))


def _pin(entry: dict[str, Any], name: str, version: str, supported: Collection[Tag],
         urls: dict[str, str], label: str) -> str | None:
    """`name==version` with the hashes of its wheels that fit the target; None without one."""
    hashes = []
    for wheel in entry.get("wheels") or []:
        url = wheel.get("url") if isinstance(wheel, dict) else None
        digest = wheel.get("hash") if isinstance(wheel, dict) else None
        if not isinstance(url, str) or urlsplit(url).scheme != "https":
            raise InvalidInput(f"{label}: a wheel without an https URL")
        if not isinstance(digest, str) or not digest.startswith("sha256:"):
            raise InvalidInput(f"{label}: {url}: no sha256 in the lock; staged files are "
                               "checked by hash (lock it again with a current uv)")
        file = unquote(url.rsplit("/", 1)[-1])
        try:
            _, _, _, tags = parse_wheel_filename(file)
        except InvalidWheelFilename as e:
            raise InvalidInput(f"{label}: {file} is not a wheel's name ({e})") from e
        if tags & set(supported):
            urls[file] = url
            hashes.append(f"--hash={digest}")
    if not hashes:
        return None
    return f"{requirement(f'{name}=={version}', label)} {' '.join(hashes)}"


def pointed(text: str, urls: dict[str, str], staged: Collection[str], folder: str) -> str:
    """The lock's text with the URL of each wheel in `staged` (file names) replaced by its
    copy in `folder`; nothing else changes (hashes, sizes, pins)."""
    for file in staged:
        if file in urls:
            text = text.replace(f'url = "{urls[file]}"',
                                f'url = "file://{folder}/{quote(file)}"')
    return text
