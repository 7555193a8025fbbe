"""What a task brings in and sends out: its context and datasets downloaded (or placed from
this machine's share) and checked by size and sha256 before the job starts, and its /output
packed (plain files only) and uploaded. Presigned URLs only: no storage credentials here.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path

import httpx

from campugrid import hooks
from campugrid.agent.messages import Lease
from campugrid.agent.shares import Shares
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import MAX_OUTPUT_BYTES


def download(http: httpx.Client, url: str, to: Path) -> None:
    with http.stream("GET", url) as resp, open(to, "wb") as out:
        resp.raise_for_status()
        for chunk in resp.iter_bytes(1024 * 1024):
            out.write(chunk)


def fetch_datasets(http: httpx.Client, lease: Lease, data_dir: Path,
                    shares: Shares | None = None) -> list[str]:
    """Every input, fetched (or found in this machine's share) and checked by size and sha256
    before the job starts: a file that changed since the job named it fails the job, with
    which file and how. Returns, per dataset, how its files moved (for the job's log)."""
    shares = shares or Shares({})
    notes = []
    for ds in lease.datasets:
        moved: dict[str, int] = {}
        total = 0
        root = (data_dir / ds.name).resolve()
        root.mkdir(parents=True, exist_ok=True)  # there, even when it holds no file
        for f in ds.files:
            target = (root / f.path).resolve()
            if not target.is_relative_to(root):
                raise InvalidInput(f"dataset {ds.name}: unsafe path {f.path!r}")
            if ds.share:
                how = shares.place(ds.share, f.path, f.sha256, target)
                moved[how] = moved.get(how, 0) + 1
                total += target.stat().st_size
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            digest, size = hashlib.sha256(), 0
            with http.stream("GET", f.url) as resp, open(target, "wb") as out:
                resp.raise_for_status()
                for chunk in resp.iter_bytes(1024 * 1024):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    if f.size and size > f.size:
                        break
            if f.sha256 and (size != f.size or digest.hexdigest() != f.sha256):
                raise InvalidInput(
                    f"dataset {ds.name}: {f.path} is not the file the job names: "
                    + (f"{size}{'+' if size > f.size else ''} bytes, not {f.size}"
                       if size != f.size else
                       f"sha256 {digest.hexdigest()[:16]}…, not {f.sha256[:16]}…")
                    + "; it changed after the job was submitted")
            moved["downloaded"] = moved.get("downloaded", 0) + 1
            total += size
        checked = ", each checked by sha256" if all(f.sha256 for f in ds.files) else ""
        notes.append(f"dataset {ds.name}: " + ", ".join(
            f"{n} file{'s' if n != 1 else ''} {how}" for how, n in sorted(moved.items()))
            + (f" from the share {ds.share!r}" if ds.share else "") + f", {total} bytes{checked}")
    return notes


def upload_output(url: str, output_dir: Path, tarball: Path) -> tuple[tuple[str, int], ...]:
    """Tar the output folder (regular files only: links the job made are skipped) and PUT it;
    what it holds, each file's path and size (nothing: there was no output)."""
    files = hooks.regular_files(output_dir)
    if not files:
        return ()
    if sum(p.stat().st_size for p in files) > MAX_OUTPUT_BYTES:
        raise InvalidInput(f"output: larger than {MAX_OUTPUT_BYTES // 1024**2} MiB; not uploaded")
    listed = []
    # Every entry a plain regular file (a hard link's second name too, with its bytes): what
    # the coordinator's digest of a verified job's output reads (coordinator/quorum.py).
    with tarfile.open(tarball, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            with os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                info = tarfile.TarInfo(str(p.relative_to(output_dir)))
                info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o755, int(st.st_mtime)
                tar.addfile(info, f)
                listed.append((info.name, st.st_size))
    size = tarball.stat().st_size
    with httpx.Client(timeout=300) as http, open(tarball, "rb") as f:
        http.put(url, content=f, headers={"content-length": str(size)}).raise_for_status()
    return tuple(listed)
