"""The agent's Debian package fetching, against the real Debian mirror (reachable from these
machines, as the package registries are), as the provider user with no root: the declared
packages and what they need beyond the base, checked by apt, into a repository that a
Buildah build under gVisor installs from with no network; clear failures for a package that
does not exist, one the declaration missed, and more than the job's disk."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.provider import buildah_build, sandbox_run

pytestmark = pytest.mark.integration
FROM = "FROM localhost/campugrid/python:bookworm\n"

STAGE = r"""
import json, os, sys, threading
from pathlib import Path
from campugrid.agent import debs
from campugrid.agent.messages import Mirror
from campugrid.protocol.dockerfiles import check_dockerfile, pin_bases
from campugrid.protocol.errors import BuildFailed, SandboxError
from campugrid.protocol.spec import BuildOptions
from campugrid.sandbox.podman_ops import CliOps
args = json.loads(sys.argv[1])
os.environ.update(args.get("env") or {})
ctx = Path(args["context"])
text = (ctx / "Dockerfile").read_text()
checked = check_dockerfile(text)
lines, out = [], {}
try:
    got = debs.stage(checked.apt, BuildOptions(apt=tuple(args["apt"])),
                     [u.allowed.name for u in checked.bases], checked.from_bases, CliOps(),
                     Path(args["work"]), disk_mb=args["disk_mb"], log=lines.append,
                     stop=threading.Event(),
                     mirror=Mirror(**args["mirror"]) if args.get("mirror") else None)
    if got is None:
        out["staged"] = None
    else:
        (ctx / "Dockerfile").write_text(pin_bases(text, {}, checked.froms, (),
                                                  got.from_args(checked.from_bases)))
        out["staged"] = {"count": got.count, "bytes": got.bytes, "folder": str(got.folder),
                         "volumes": [[str(h), i] for h, i in got.volumes()],
                         "files": {r: sorted(p.name for p in (got.folder / r).iterdir())
                                   for r in got.repos.values()}}
except BuildFailed as e:
    out["failed"] = e.reason
except SandboxError as e:
    out["machine"] = e.reason
out["log"] = lines
print(json.dumps(out))
"""


def stage(provider, root: Path, dockerfile: str, *, apt: tuple[str, ...] = (),
          disk_mb: int = 256, mirror: dict[str, str] | None = None,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """debs.stage as the provider user (its Podman holds the base), for `dockerfile` on the
    local base; `mirror`: a Mirror's fields, to fetch through the platform's apt cache."""
    ctx, work = root / "ctx", root / "work"
    for d in (ctx, work):
        d.mkdir()
    (ctx / "Dockerfile").write_text(FROM + dockerfile)
    if os.geteuid() == 0:
        for p in (root, ctx, work, ctx / "Dockerfile"):
            os.chown(p, provider.uid, provider.gid)
    args = {"context": str(ctx), "work": str(work), "apt": list(apt), "disk_mb": disk_mb,
            "mirror": mirror, "env": env}
    proc = subprocess.run(provider.command([sys.executable, "-c", STAGE, json.dumps(args)]),
                          capture_output=True, text=True, timeout=900, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["context"] = str(ctx)
    return got


def explained(res: dict[str, Any], staged: set[str]) -> str:
    """What the agent says of a failed build, with these packages staged for it."""
    from campugrid.agent import debs
    from campugrid.protocol.errors import BuildFailed
    return debs.explain(BuildFailed(res["reason"], res["tail"]),
                        debs.Staged(Path("/x"), {}, 0, 0, frozenset(staged))).reason


def test_declared_packages_install_offline_in_the_build_from_the_staged_repository(
        provider, shared_tmp):
    got = stage(provider, shared_tmp,
                "RUN apt-get update && apt-get install -y --no-install-recommends jq && "
                "rm -rf /var/lib/apt/lists/*\n"
                "RUN echo '{\"answer\": 42}' | jq .answer > /answer\n"
                "RUN python3 -c \"import socket; socket.create_connection(('deb.debian.org', "
                "80), timeout=3)\" 2>/dev/null && echo NET-REACHED > /net || echo offline > /net\n",
                apt=("libonig5",))
    staged = got["staged"]
    assert staged is not None, got
    # jq and what it needs beyond the base (libjq1, libonig5): nothing the base already has
    debs = [f for f in staged["files"]["0"] if f.endswith(".deb")]
    assert sorted(f.split("_")[0] for f in debs) == ["jq", "libjq1", "libonig5"], debs
    assert {"Packages", "apt.conf", "sources.list"} <= set(staged["files"]["0"])
    assert staged["volumes"] == [[staged["folder"], "/dev/campugrid-apt"]]
    log = "\n".join(got["log"])
    assert "fetching Debian packages for debian bookworm (amd64) from http://deb.debian.org" in log
    assert "staged 3 Debian packages" in log and "[campugrid] deb jq " in log
    dockerfile = Path(got["context"], "Dockerfile").read_text()
    assert "ARG APT_CONFIG=/dev/campugrid-apt/0/apt.conf" in dockerfile
    tag = "localhost/campugrid-test/apt-offline:1"
    res = buildah_build(provider, got["context"], tag,
                        volumes=[tuple(v) for v in staged["volumes"]])  # type: ignore[misc]
    try:
        assert res["ok"], res
        out = "\n".join(res["lines"])
        assert "file:/dev/campugrid-apt/0 ./ Packages" in out  # apt's only source
        assert not re.search(r"^(Get|Hit|Ign|Err):\d+ http", out, re.M), out
        out_dir = shared_tmp / "out"
        out_dir.mkdir()
        os.chown(out_dir, provider.uid, provider.gid) if os.geteuid() == 0 else None
        run = sandbox_run(provider, name="t-apt", image=tag, output_dir=str(out_dir),
                          command=["sh", "-c", "cat /answer /net; jq --version; "
                                               "ls -A /dev/campugrid-apt 2>/dev/null | wc -l"])
        # the job's image runs jq; the build's RUN had no network; the repository's mount
        # point stays only as an empty folder under /dev, which the sandbox mounts afresh
        assert run["exit_code"] == 0 and run["lines"][:3] == ["42", "offline", "jq-1.6"], run
        assert run["lines"][3] == "0", run  # absent or empty: none of the repository
    finally:
        subprocess.run(provider.command(["podman", "rmi", "-f", tag]), capture_output=True)


def test_a_package_the_declaration_missed_fails_the_build_naming_it(provider, shared_tmp):
    """jq is declared; the script the build runs installs tree too, unseen before the build."""
    got = stage(provider, shared_tmp, "RUN apt-get update && apt-get install -y jq\n"
                "RUN sh -c \"$(printf 'apt-get install -y tree')\"\n")
    assert got["staged"] is not None, got
    res = buildah_build(provider, got["context"], "localhost/campugrid-test/apt-missed:1",
                        volumes=[tuple(v) for v in got["staged"]["volumes"]])  # type: ignore[misc]
    assert not res["ok"]
    assert explained(res, {"jq", "libjq1", "libonig5"}).startswith(
        "a RUN step installs tree with apt, which was not declared")
    # a declared package apt does not find: its lists were never read (no apt-get update)
    assert explained({"reason": "build failed", "tail": "E: Unable to locate package jq"},
                     {"jq"}).startswith("a RUN step's apt found no jq, which was fetched for "
                                        "it: run `apt-get update` before `apt-get install`")


def test_no_such_package_is_refused_before_the_build_naming_it(provider, shared_tmp):
    got = stage(provider, shared_tmp, "RUN apt-get install -y jq no-such-package-x7\n")
    assert got.get("failed", "").startswith(
        "Debian package no-such-package-x7: not in debian bookworm"), got


def test_the_packages_count_against_the_jobs_disk_before_they_are_fetched(provider, shared_tmp):
    got = stage(provider, shared_tmp, "RUN apt-get install -y gcc\n", disk_mb=1)
    assert "Debian packages take" in got.get("failed", "") and "disk_mb" in got["failed"], got
    assert not [line for line in got["log"] if "[apt] Get:" in line and " gcc" in line]


def test_without_the_distributions_keyring_here_the_bases_own_is_used(provider, shared_tmp):
    """Debian hosts have no Ubuntu keyring: then the base image's copy checks the release
    (in a cache of its own per keyring)."""
    got = stage(provider, shared_tmp, "RUN apt-get install -y jq\n",
                env={"CAMPUGRID_APT_KEYRINGS": "/nonexistent"})
    assert got.get("staged") is not None, got
    assert any("with the base image's own debian-archive-keyring.gpg" in line
               for line in got["log"]), got["log"]


def test_nothing_is_fetched_when_no_stage_uses_apt(provider, shared_tmp):
    assert stage(provider, shared_tmp, "RUN echo no apt here\n")["staged"] is None


def test_apts_lists_are_fetched_again_only_after_five_minutes(provider, shared_tmp):
    """A build a minute after another skips `apt-get update` (1.5 s here) for the same
    sources; lists older than LISTS_FRESH_S, or fetched for other sources, are fetched."""
    def staged(n: int) -> list[str]:
        root = shared_tmp / str(n)
        root.mkdir()
        got = stage(provider, root, "RUN apt-get update && apt-get install -y jq\n")
        assert got.get("staged") is not None and got["staged"]["count"] == 3, got
        return got["log"]

    markers = list((provider.home / ".cache/campugrid/apt").glob("debian-bookworm-*/lists-updated"))
    for marker in markers:  # as if the last update were ten minutes ago
        os.utime(marker, (time.time() - 600, time.time() - 600))
    first, second = staged(1), staged(2)
    assert any(re.match(r"\[apt\] (Get|Hit):\d+ http://deb\.debian\.org/debian bookworm InRelease",
                        line) for line in first), first
    assert not any(line.startswith("[apt] Hit:") or (line.startswith("[apt] Get:") and
                   "InRelease" in line) for line in second), second
    assert any(re.search(r"apt's lists for bookworm were fetched \d+ s ago \(at most every 5 "
                         r"minutes\): not fetched again", line) for line in second), second
    for marker in (provider.home / ".cache/campugrid/apt").glob("debian-bookworm-*/lists-updated"):
        marker.write_text("0" * 64)  # just now, but for other sources (a mirror's, say)
    third = staged(3)
    assert any(re.match(r"\[apt\] (Get|Hit):\d+ http://deb\.debian\.org/debian bookworm InRelease",
                        line) for line in third), third


def test_the_same_packages_are_planned_once_while_apts_lists_last(provider, shared_tmp):
    """apt's plan (`--simulate` and its records: 1.1 s of a build here) is kept for the same
    packages on the same dpkg status until the lists change, and apt is not run at all when
    every .deb is kept here as its record says; apt takes a kept .deb of the right size as it
    is, so one that is not as its record says is removed first, and fetched again."""
    cache = provider.home / ".cache/campugrid/apt"

    def staged(n: int, line: str = "RUN apt-get update && apt-get install -y jq\n"
               ) -> tuple[list[str], str]:
        root = shared_tmp / str(n)
        root.mkdir()
        got = stage(provider, root, line)
        assert got.get("staged") is not None and got["staged"]["count"] >= 3, got
        return got["log"], (Path(got["staged"]["folder"]) / "0" / "Packages").read_text()

    def jq_as_recorded(packages: str) -> bool:
        digest = re.search(r"^SHA256: (\S+)$", packages.split("Package: jq\n")[1], re.M)
        assert digest, packages
        return hashlib.sha256(kept[0].read_bytes()).hexdigest() == digest[1]

    for marker in cache.glob("debian-bookworm-*/lists-updated"):  # lists ten minutes old
        os.utime(marker, (time.time() - 600, time.time() - 600))
    again = re.compile(r"\[campugrid\] apt's plan for these packages, made from the same lists "
                       r"and dpkg status \d+ s ago: used again")
    first, packages = staged(1)
    assert not any(again.match(line) for line in first), first
    second, packages_again = staged(2)
    assert any(again.match(line) for line in second), second
    assert not any(line.startswith("[apt]") for line in second), second  # no apt at all
    assert packages_again == packages and "Package: jq\n" in packages
    # the same packages on other lines of the Dockerfile: the same plan
    assert any(again.match(line) for line in staged(3, "RUN apt-get install -y jq\n")[0])

    kept = list(cache.glob("debian-bookworm-*/archives/jq_*.deb"))
    assert len(kept) == 1 and jq_as_recorded(packages), kept
    damaged = kept[0].with_name("damaged")
    damaged.write_bytes(b"\0" * kept[0].stat().st_size)  # the same size, not the same bytes
    if os.geteuid() == 0:
        os.chown(damaged, provider.uid, provider.gid)
    damaged.replace(kept[0])
    fourth, packages = staged(4)
    assert any(again.match(line) for line in fourth), fourth
    assert any(re.match(r"\[apt\] Get:\d+ .* jq ", line) for line in fourth), fourth
    assert jq_as_recorded(packages)
    # a .deb found good is not hashed again while its size, time and inode stay (CUDA's are
    # gigabytes); one written over in place (the same inode, a new time) is hashed again
    checked = json.loads((kept[0].parent.parent / "checked.json").read_text())
    assert checked[kept[0].name][3] == hashlib.sha256(kept[0].read_bytes()).hexdigest()
    with kept[0].open("r+b") as f:
        f.write(b"\0" * 64)
    fifth, packages = staged(5)
    assert any(re.match(r"\[apt\] Get:\d+ .* jq ", line) for line in fifth), fifth
    assert jq_as_recorded(packages)

    other, _ = staged(6, "RUN apt-get install -y jq tree\n")  # another plan
    assert not any(again.match(line) for line in other), other
