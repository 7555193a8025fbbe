"""A release's apt cache on this machine, between builds (agent/debs.py fetches into it): one
task at a time on it, apt's plans kept while the lists they were made from last, the .debs
checked against their index records before a build uses them, and its size bound."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from campugrid.protocol.errors import SandboxError
from campugrid.sandbox.process import LogFn

MARKER = "lists-updated"  # the sources of the last `apt-get update` that ended well


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "campugrid" / "apt"


def plan_file(cache: Path, status: bytes, commands: list[list[str]]) -> Path:
    """Where the plan for these apt commands on this dpkg status is kept: named by them and by
    the lists it is made from (the update marker's sources and time, which every update
    changes)."""
    marker = cache / MARKER
    made = marker.stat()
    key = hashlib.sha256(json.dumps([marker.read_text(), made.st_mtime_ns, made.st_size,
                                     hashlib.sha256(status).hexdigest(), commands]).encode())
    return cache / "plans" / f"{key.hexdigest()}.json"


def drop_plans(cache: Path) -> None:
    """Before the lists change: no plan made from them is used again."""
    shutil.rmtree(cache / "plans", ignore_errors=True)


def planned_before(plan: Path) -> tuple[dict[str, tuple[str, str, str]], list[str]] | None:
    """The plan remember_plan kept (which .debs, and apt's records of them), if it was."""
    try:
        saved = json.loads(plan.read_text())
        wanted = {str(f): (str(n), str(v), str(a)) for f, (n, v, a) in saved["wanted"].items()}
        return wanted, [str(r) for r in saved["records"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None


def kept(wanted: Mapping[str, tuple[str, str, str]], records: list[str], archives: Path
         ) -> set[str]:
    """The wanted .debs in `archives` with their record's sha256; any other copy is removed.
    A .deb is hashed again only when its size, time or inode changed since it was last
    found good (CUDA's packages are gigabytes)."""
    sums = {}
    for record in records:
        fields = dict(re.findall(r"^(Package|Version|Architecture|SHA256): (\S+)$", record, re.M))
        sums[(fields.get("Package"), fields.get("Version"), fields.get("Architecture"))] = \
            fields.get("SHA256")
    checked = archives.parent / "checked.json"  # name -> [size, mtime_ns, inode, sha256]
    try:
        known = {str(k): list(v) for k, v in json.loads(checked.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        known = {}
    good = set()
    for name, ident in wanted.items():
        path = archives / name
        try:
            st = path.stat()
            seen = [st.st_size, st.st_mtime_ns, st.st_ino]
            memo = known.get(name)
            digest = str(memo[3]) if memo and len(memo) == 4 and memo[:3] == seen \
                else _sha256(path)
            if digest == sums.get(ident):
                good.add(name)
                known[name] = [*seen, digest]
                with contextlib.suppress(OSError):  # used now: the last trim removes
                    os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
            else:
                path.unlink()
                known.pop(name, None)
        except OSError:
            known.pop(name, None)  # not there
    with contextlib.suppress(OSError):
        partial = checked.with_suffix(".partial")
        partial.write_text(json.dumps({k: v for k, v in known.items() if (archives / k).exists()}))
        partial.replace(checked)
    return good


def remember_plan(plan: Path, wanted: Mapping[str, tuple[str, str, str]],
                   records: list[str]) -> None:
    with contextlib.suppress(OSError):
        plan.parent.mkdir(exist_ok=True)
        partial = plan.with_suffix(".partial")
        partial.write_text(json.dumps({"wanted": wanted, "records": records}))
        partial.replace(plan)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One task at a time on a release's cache (apt runs here without its own locks)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def link(source: Path, target: Path) -> None:
    if not source.is_file():
        raise SandboxError(f"apt-get reported {source.name} but did not download it")
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def trim(archives: Path, log: LogFn) -> None:
    """The .debs a release's cache keeps for later builds stay under CAMPUGRID_APT_CACHE_MB
    (default 2048): past it, the least recently used go (this build's are linked already)."""
    limit = int(os.environ.get("CAMPUGRID_APT_CACHE_MB") or 2048) * 1024**2
    debs = sorted(archives.glob("*.deb"), key=lambda p: p.stat().st_atime)
    total = sum(p.stat().st_size for p in debs)
    if total <= limit:
        return
    while debs and total > limit:
        oldest = debs.pop(0)
        total -= oldest.stat().st_size
        oldest.unlink(missing_ok=True)
    log(f"[campugrid] apt's cache passed {limit // 1024**2} MB and was trimmed")
