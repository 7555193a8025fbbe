"""Build contexts: the tarball a researcher uploads (a Dockerfile plus the files it copies).

`inspect_context` is the gate at the coordinator: it refuses, with a reason, anything the
agent would refuse later. `extract_context` is the agent's own check-and-unpack, written
member by member (this Python has no tarfile data filter), so a hostile tarball cannot
write outside the folder, create devices, or fill the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import posixpath
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from campugrid import hooks
from campugrid.buildpolicy.dockerfiles import AllowedBase, CheckedDockerfile, check_dockerfile
from campugrid.protocol.errors import InvalidInput

MAX_MEMBERS = 20_000
MAX_UNPACKED_BYTES = 2 * 1024**3
MAX_DOCKERFILE_BYTES = 1024**2
DOCKERFILE = "Dockerfile"


@dataclasses.dataclass(frozen=True)
class ContextInfo:
    members: int
    unpacked_bytes: int
    dockerfile: str
    checked: CheckedDockerfile  # its stages and the allowed bases it builds on


_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error)


@contextlib.contextmanager
def _archive_errors(what: str) -> Iterator[None]:
    """A truncated or corrupt archive is bad input, whichever read notices it first."""
    try:
        yield
    except _ARCHIVE_ERRORS as e:
        raise InvalidInput(f"{what}: damaged archive ({type(e).__name__}: {e})") from e


def inspect_context(data: bytes | BinaryIO, allowed: Sequence[AllowedBase] | None = None,
                    registries: Sequence[str] | None = None) -> ContextInfo:
    """Check an uploaded context (its bytes, or a seekable file of them) without unpacking
    it; raise InvalidInput with the reason. `allowed`: the base images a build may start from,
    `registries` those a FROM may pull from (default: from configuration)."""
    with _archive_errors("context"):
        return _inspect(data, allowed, registries)


def _inspect(data: bytes | BinaryIO, allowed: Sequence[AllowedBase] | None,
             registries: Sequence[str] | None) -> ContextInfo:
    total = 0
    count = 0
    dockerfile: bytes | None = None
    links: dict[str, str] = {}
    names: set[str] = set()
    with _open(data) as tar:
        for member, name in _checked_members(tar):
            count += 1
            names.add(name)
            if member.issym():
                links[name] = member.linkname
            total += member.size if member.isfile() else 0
            if total > MAX_UNPACKED_BYTES:
                raise InvalidInput(
                    f"context: unpacks to more than {MAX_UNPACKED_BYTES // 1024**2} MiB")
            if name == DOCKERFILE and member.isfile():
                if member.size > MAX_DOCKERFILE_BYTES:
                    raise InvalidInput("context: Dockerfile is larger than 1 MiB")
                f = tar.extractfile(member)
                assert f is not None
                dockerfile = f.read()
    # Where each link really lands (its folder may itself pass through links, as when the
    # agent makes them in this order), then where each one leads.
    placed: dict[str, str] = {}
    for name, link in links.items():
        folder = _resolve(posixpath.dirname(name), placed)
        if folder is None:
            raise InvalidInput(f"context: symlink {name} lies outside the context (through "
                               "other links)")
        placed[posixpath.join(folder, posixpath.basename(name))] = link
    for name, link in placed.items():
        if _resolve(name, placed) is None:
            raise InvalidInput(f"context: symlink {name} -> {link} resolves outside the context "
                               "(through other links)")
    if dockerfile is None:
        raise InvalidInput("context: no Dockerfile at the top of the tarball "
                           "(tar it from inside the folder: tar -C DIR -czf ctx.tgz .)")
    try:
        text = dockerfile.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput("context: Dockerfile is not UTF-8 text") from e
    checked = check_dockerfile(text, allowed, registries)
    for line, source in checked.sources:
        if not _in_context(source, names, links):
            raise InvalidInput(f"Dockerfile line {line}: {source} is not in the build context "
                               "(the folder submitted, less what its .dockerignore leaves out)")
    return ContextInfo(members=count, unpacked_bytes=total, dockerfile=text, checked=checked)


def _in_context(source: str, names: set[str], links: dict[str, str]) -> bool:
    """Whether a COPY or ADD source can be found in the context: a file or folder there, or
    a path through a link or a pattern (both left to the build: builders differ on patterns
    that match nothing, and on their syntax). Only a plain path that is not there is told."""
    path = posixpath.normpath(source.lstrip("/"))
    if path in (".", "") or path in names or any(c in path for c in "*?[\\"):
        return True
    parts = path.split("/")
    if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
        return True
    return any(n.startswith(path + "/") for n in names)  # a folder without its own entry


def extract_context(data: bytes, dest: Path, allowed: Sequence[AllowedBase] | None = None,
                    registries: Sequence[str] | None = None) -> ContextInfo:
    """Unpack a context into the empty folder `dest`, checking every member again.

    Folders and files are written first, hard links are copied from files already written,
    and symbolic links are made last, so nothing is ever written through a link; then every
    link is resolved for real and the whole context is refused if one leads outside.
    """
    info = inspect_context(data, allowed, registries)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    try:
        with _archive_errors("context"):
            _unpack(data, root)
    except FileExistsError as e:
        shutil.rmtree(root, ignore_errors=True)
        where = e.filename2 if isinstance(e.filename2, str) else e.filename
        raise InvalidInput(f"context: {os.path.relpath(str(where), root)} appears twice "
                           "(as a file, folder or link)") from e
    except InvalidInput:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return info


def extract_context_file(archive: Path, dest: Path, allowed: Sequence[AllowedBase] | None = None,
                         registries: Sequence[str] | None = None) -> ContextInfo:
    """extract_context of a downloaded tarball: what the agent runs in a confined child."""
    return extract_context(archive.read_bytes(), dest, allowed, registries)


def extract_checkpoint(archive: Path, dest: Path) -> int:
    """A downloaded checkpoint, unpacked (plain files only) and checked against its own
    manifest: what the agent runs in a confined child. Returns the number of files."""
    count = extract_files(archive, dest)
    try:
        hooks.verify(dest)
    except hooks.CheckpointError as e:
        raise InvalidInput(str(e)) from e
    return count


def _unpack(data: bytes, root: Path) -> None:
    links: list[tuple[str, str]] = []
    hardlinks: list[tuple[str, str]] = []
    with _open(data) as tar:
        for member, name in _checked_members(tar):
            target = root / name
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.issym():
                links.append((name, member.linkname))
            elif member.islnk():
                hardlinks.append((name, _normalise(member.linkname)))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                f = tar.extractfile(member)
                assert f is not None
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o755 if member.mode & stat.S_IXUSR else 0o644)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(f, out)
    for name, source in hardlinks:
        src = root / source
        if src.is_symlink() or not src.is_file():
            raise InvalidInput(f"context: hard link {name} points at {source}, not a file")
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / name, follow_symlinks=False)
    for name, link in links:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link, root / name)
    for name, link in links:
        real = Path(os.path.realpath(root / name))
        if real != root and root not in real.parents:
            raise InvalidInput(f"context: symlink {name} -> {link} resolves outside the context")


def extract_files(archive: Path, dest: Path) -> int:
    """Unpack a tar of plain files and folders (a checkpoint) into `dest`; links, devices and
    escaping paths are refused. Returns the number of files."""
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    count = 0
    try:
        tar = tarfile.open(archive, mode="r:*")  # noqa: SIM115 - closed by `with tar` below
    except (tarfile.TarError, OSError) as e:
        raise InvalidInput(f"{archive.name}: not a tar archive ({e})") from e
    with tar, _archive_errors(archive.name):
        for member, name in _checked_members(tar):
            target = root / name
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                f = tar.extractfile(member)
                assert f is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(f, out)
                count += 1
            else:
                raise InvalidInput(f"{archive.name}: {name} is a link; checkpoints hold plain files")
    return count


def _resolve(path: str, links: dict[str, str]) -> str | None:
    """`path` inside the context as realpath would resolve it through the context's own
    links, without unpacking; None if it leaves the context, or loops."""
    pending = path.split("/")
    resolved: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return None
            resolved.pop()
            continue
        here = "/".join([*resolved, part])
        if here in links:
            hops += 1
            if hops > 40 or links[here].startswith("/"):
                return None
            pending = links[here].split("/") + pending  # relative to the link's folder
            continue
        resolved.append(part)
    return "/".join(resolved)


def _open(data: bytes | BinaryIO) -> tarfile.TarFile:
    try:
        if isinstance(data, bytes):
            return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
        data.seek(0)
        return tarfile.open(fileobj=data, mode="r:*")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise InvalidInput(f"context: not a tar or tar.gz archive ({e})") from e


def _normalise(name: str) -> str:
    if "\x00" in name:
        raise InvalidInput("context: a member name contains NUL")
    if name.startswith("/"):
        raise InvalidInput(f"context: absolute path {name!r} is not allowed")
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../"):
        raise InvalidInput(f"context: path {name!r} leaves the context folder")
    return norm


def _checked_members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str]]:
    count = 0
    try:
        for member in tar:
            count += 1
            if count > MAX_MEMBERS:
                raise InvalidInput(f"context: more than {MAX_MEMBERS} files")
            name = _normalise(member.name)
            if name == ".":
                continue
            if member.issym():
                link = member.linkname
                if link.startswith("/"):
                    raise InvalidInput(f"context: symlink {name} -> {link} is absolute")
                resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), link))
                if resolved == ".." or resolved.startswith("../"):
                    raise InvalidInput(f"context: symlink {name} -> {link} leaves the context")
            elif member.islnk():
                _normalise(member.linkname)
            elif not (member.isfile() or member.isdir()):
                raise InvalidInput(
                    f"context: {name} is a device, fifo or other special file; only files, "
                    "folders and links are allowed")
            yield member, name
    except _ARCHIVE_ERRORS as e:
        raise InvalidInput(f"damaged archive ({type(e).__name__}: {e})") from e
