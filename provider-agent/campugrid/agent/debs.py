"""A build's Debian packages, fetched before it into a local repository: RUN steps keep no
network.

What to fetch is what the job declares (protocol/aptwords.py): the packages its Dockerfile's
`apt-get install` / `apt install` lines name, and the spec's `build.apt`; a line that
upgrades has the base's upgrades fetched too. The agent's own apt-get resolves them here,
outside any sandbox, for the release of the base image each stage builds on (its
/etc/os-release) against what that image already has (its dpkg status), and downloads them:

- from the distribution's own mirror (deb.debian.org, archive.ubuntu.com: never an address
  the image's sources.list names), through CAMPUGRID_APT_PROXY (the platform's apt cache)
  when set;
- checked as apt checks them: the mirror's Release file signed by a key of the distribution's
  keyring on this machine (CAMPUGRID_APT_KEYRINGS, default /usr/share/keyrings), each .deb
  against that Release's hashes;
- into this user's cache (one per release; lists and archives, bounded by
  CAMPUGRID_APT_CACHE_MB), as its own user, with no root; apt's plan for the same packages
  on the same dpkg status is kept until the lists change, and apt is not run when each .deb
  it names is kept with its record's sha256 (agent/aptcache.py).

A .deb is unpacked by dpkg inside the build, never here. Each stage's packages become a flat
repository (the .debs, a Packages index written from apt's own records) that RUN steps see
read-only at IN_BUILD; the agent's copy of the Dockerfile declares `ARG APT_CONFIG=...` after
each FROM (protocol.dockerfiles.pin_bases), a configuration whose only source is that
repository. `apt-get update && apt-get install -y ...` then runs unchanged, offline; a package
the declaration missed is not there, and the build fails naming it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from campugrid.agent import aptcache
from campugrid.agent.messages import Mirror
from campugrid.protocol.aptwords import AptInstall
from campugrid.protocol.errors import BuildFailed, SandboxError
from campugrid.protocol.spec import BuildOptions
from campugrid.sandbox.podman_ops import PodmanOps
from campugrid.sandbox.process import LogFn, run_streaming

IN_BUILD = "/dev/campugrid-apt"
APT_TIMEOUT_S = 1800
MAX_STATUS_BYTES = 64 * 1024**2
# apt's lists of a release are fetched again at most this often, for the same sources (1.5 s
# of a build here; pip's own cache keeps an index page 10 minutes): newer than the
# distribution publishes them in the hour, older than a rebuild a minute later needs.
LISTS_FRESH_S = 300
# What a base image's files said (os-release, dpkg status), by image ID; each read costs a
# container made and removed (0.4 s). At most this many bytes kept.
READ_KEPT_BYTES = 32 * 1024**2
# Each distribution's mirror, security mirror and components, as its own images list them.
MIRRORS = {
    "debian": ("http://deb.debian.org/debian", "http://deb.debian.org/debian-security",
               "main"),
    "ubuntu": ("http://archive.ubuntu.com/ubuntu", "http://security.ubuntu.com/ubuntu",
               "main restricted universe multiverse"),
}
PORTS = "http://ports.ubuntu.com/ubuntu-ports"  # Ubuntu's mirror for arm64 and others
KEYRINGS = {"debian": "debian-archive-keyring.gpg", "ubuntu": "ubuntu-archive-keyring.gpg"}
KEYRING_PACKAGES = {"debian": "debian-archive-keyring", "ubuntu": "ubuntu-keyring"}
_STATUS_FIELDS = ("Package", "Status", "Version", "Architecture", "Multi-Arch", "Essential",
                  "Priority", "Source", "Provides", "Depends", "Pre-Depends", "Conflicts",
                  "Breaks", "Replaces")
DPKG_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64el", "s390x": "s390x"}
_NETWORK = re.compile(r"Could not resolve|Temporary failure resolving|Could not connect|"
                      r"Connection failed|Unable to connect|Failed to fetch|timed out")
_MISSING = (re.compile(r"Unable to locate package (\S+)"),
            re.compile(r"Package '?([^' ]+)'? has no installation candidate"),
            re.compile(r"Version '[^']+' for '([^']+)' was not found"),
            re.compile(r"Release '[^']+' for '([^']+)' was not found"))


@dataclasses.dataclass(frozen=True)
class Release:
    """The distribution release a base image is (its /etc/os-release)."""

    distro: str  # "debian", "ubuntu"
    codename: str  # "bookworm", "jammy"
    arch: str  # dpkg's name for this machine's architecture

    @property
    def name(self) -> str:
        return f"{self.distro}-{self.codename}-{self.arch}"

    def sources(self, through: str = "") -> str:
        """The release's sources.list; with `through`, each URL as the platform's apt cache
        serves it (<through>/<host>/<path>)."""
        main, security, components = MIRRORS[self.distro]
        if self.distro == "ubuntu" and self.arch not in ("amd64", "i386"):
            main = security = PORTS
        if through:
            main, security = (url.replace("http://", through.rstrip("/") + "/", 1)
                              for url in (main, security))
        return (f"deb {main} {self.codename} {components}\n"
                f"deb {main} {self.codename}-updates {components}\n"
                f"deb {security} {self.codename}-security {components}\n")


def release_of(os_release: bytes | None, image: str) -> Release:
    """The release of an image by its os-release; BuildFailed for one apt cannot serve."""
    fields = dict(re.findall(r'^([A-Z_]+)="?([^"\n]*)"?$', (os_release or b"").decode(
        "utf-8", "replace"), re.M))
    distro = fields.get("ID", "")
    if distro not in MIRRORS:
        like = fields.get("ID_LIKE", "").split()
        distro = "ubuntu" if "ubuntu" in like else "debian" if "debian" in like else distro
    codename = fields.get("VERSION_CODENAME") or fields.get("UBUNTU_CODENAME") or ""
    if distro not in MIRRORS or not re.fullmatch(r"[a-z]{2,32}", codename):
        what = f"{fields.get('PRETTY_NAME') or fields.get('ID') or 'no /etc/os-release'}"
        raise BuildFailed(f"{image} ({what}): apt packages are fetched for Debian and Ubuntu "
                          "bases only, by their release name (VERSION_CODENAME); build on "
                          "one, or install with the base's own tools from files in the "
                          "context", "")
    arch = DPKG_ARCH.get(platform.machine(), platform.machine())
    return Release(distro, codename, arch)


@dataclasses.dataclass(frozen=True)
class Staged:
    """The Debian packages of one build: one repository per base image, under `folder`
    (mounted at IN_BUILD); `repos` maps a base's index (CheckedDockerfile.bases) to its."""

    folder: Path
    repos: Mapping[int, str]
    count: int
    bytes: int
    names: frozenset[str] = frozenset()  # the packages staged, by name

    def volumes(self) -> tuple[tuple[Path, str], ...]:
        return ((self.folder, IN_BUILD),)

    def from_args(self, from_bases: Sequence[int | None]) -> dict[int, tuple[tuple[str, str], ...]]:
        """For each FROM (by its index) whose stage builds on a base with a repository, the
        build argument that points apt at it."""
        return {i: (("APT_CONFIG", f"{IN_BUILD}/{self.repos[base]}/apt.conf"),)
                for i, base in enumerate(from_bases) if base is not None and base in self.repos}


def stage(installs: Sequence[AptInstall], build: BuildOptions, bases: Sequence[str],
          from_bases: Sequence[int | None], ops: PodmanOps, work: Path, *, disk_mb: int,
          log: LogFn, stop: threading.Event | None, mirror: Mirror | None = None
          ) -> Staged | None:
    """Fetch the declared packages for each base image (`bases`: the local image of each of
    the Dockerfile's bases) into repositories under `work`; None when the build installs
    nothing with apt. Through the platform's apt cache when `mirror` is given (and
    CAMPUGRID_APT_PROXY is not set). Raises BuildFailed for the job's faults (a package no
    release has, more than `disk_mb`), SandboxError when this machine cannot fetch."""
    groups: dict[int, list[AptInstall]] = {}
    for use in installs:
        base = from_bases[use.stage] if use.stage < len(from_bases) else None
        if base is not None:
            groups.setdefault(base, []).append(use)
    if build.apt and not groups and from_bases and from_bases[-1] is not None:
        groups[from_bases[-1]] = []
    if not groups:
        return None
    if shutil.which("apt-get") is None:
        raise SandboxError("this machine has no apt-get: it cannot fetch the Debian packages "
                           "a build installs")
    folder = work / "debs"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    repos: dict[int, str] = {}
    names: set[str] = set()
    count = total = 0
    for n, (base, uses) in enumerate(sorted(groups.items())):
        image = bases[base]
        release = release_of(_image_file(ops, image, "/etc/os-release", 64 * 1024), image)
        try:
            status = installed(_image_file(ops, image, "/var/lib/dpkg/status",
                                           MAX_STATUS_BYTES) or b"")
        except ValueError as e:
            raise BuildFailed(f"{image}: its dpkg status is too large to read ({e})", "") from e
        packages = list(dict.fromkeys([p for u in uses for p in u.packages] + list(build.apt)))
        # Recommends as the lines ask (apt's default, unless every line says no)
        recommends = any(u.recommends for u in uses if u.packages) or \
            not any(u.packages for u in uses)
        upgrade = any(u.upgrade for u in uses)
        repo = folder / str(n)
        keyring = _keyring(release, ops, image, log)
        fetch = functools.partial(_fetch, release, status, packages, recommends, upgrade,
                                  repo, work / f"apt-{n}", disk_mb * 1024**2 - total, log,
                                  stop, keyring=keyring)
        try:
            got, size = fetch(mirror=mirror)
        except SandboxError as e:
            if mirror is None or os.environ.get("CAMPUGRID_APT_PROXY"):
                raise
            # The platform's cache is out of this machine's reach: the mirrors themselves.
            log(f"[campugrid] {e.reason} through the platform's cache; fetching from the "
                "distribution's mirrors instead")
            shutil.rmtree(repo, ignore_errors=True)
            got, size = fetch(mirror=None)
        repos[base] = str(n)
        names |= {name for name, _, _ in got}
        count, total = count + len(got), total + size
    for path in (folder, *folder.rglob("*")):  # RUN steps read them as apt's own user too
        path.chmod(0o755 if path.is_dir() else 0o644)
    return Staged(folder, repos, count, total, frozenset(names))


_read: collections.OrderedDict[tuple[str, str, int], bytes | None] = collections.OrderedDict()
_read_lock = threading.Lock()


def _image_file(ops: PodmanOps, image: str, path: str, max_bytes: int) -> bytes | None:
    """ops.image_file, read from the image's ID and kept by it (in one store an ID names one
    image, whatever its names; a name moved to another image is read again)."""
    ident = ops.image_id(image)
    if ident is None:
        return None
    key = (ident, path, max_bytes)
    with _read_lock:
        if key in _read:
            _read.move_to_end(key)
            return _read[key]
    got = ops.image_file(ident, path, max_bytes)
    with _read_lock:
        _read[key] = got
        while sum(len(v or b"") for v in _read.values()) > READ_KEPT_BYTES:
            _read.popitem(last=False)
    return got


def _keyring(release: Release, ops: PodmanOps, image: str, log: LogFn) -> bytes:
    """The keys apt checks the release's signature with: this machine's keyring for the
    distribution (CAMPUGRID_APT_KEYRINGS), else the base image's own copy of it (Debian hosts
    have no Ubuntu keyring). An image's keys are the job's: they get a cache of their own."""
    name = KEYRINGS[release.distro]
    here = Path(os.environ.get("CAMPUGRID_APT_KEYRINGS") or "/usr/share/keyrings") / name
    if here.is_file():
        return here.read_bytes()
    try:
        theirs = _image_file(ops, image, f"/usr/share/keyrings/{name}", 1024**2)
    except ValueError:
        theirs = None
    if not theirs:
        raise SandboxError(f"neither this machine nor {image} has {name} to check "
                           f"{release.distro}'s packages with (Debian: apt-get install "
                           f"{KEYRING_PACKAGES[release.distro]})")
    log(f"[campugrid] checking {release.distro}'s signatures with the base image's own {name} "
        "(this machine has none)")
    return theirs


def installed(status: bytes) -> bytes:
    """What apt here needs of an image's dpkg status, and nothing else: each installed
    package's relation fields, in plain printable text. The file is the job's (its base
    image's); apt reads only this re-written copy."""
    keep = []
    for stanza in status.decode("utf-8", "replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?([^\n]*(?:\n [^\n]*)*)", stanza, re.M))
        name, version = fields.get("Package", ""), fields.get("Version", "")
        if fields.get("Status") != "install ok installed" or not re.fullmatch(
                r"[a-z0-9][a-z0-9+.-]+", name) or not re.fullmatch(r"[A-Za-z0-9.+:~_-]+",
                                                                     version):
            continue
        lines = [f"{field}: {' '.join(value.split())}" for field, value in fields.items()
                 if field in _STATUS_FIELDS and re.fullmatch(r"[ -~\n]*", value)]
        keep.append("\n".join(lines))
    return ("\n\n".join(keep) + "\n").encode()


def _fetch(release: Release, status: bytes, packages: list[str], recommends: bool,
           upgrade: bool, repo: Path, scratch: Path, budget: int, log: LogFn,
           stop: threading.Event | None, *, mirror: Mirror | None, keyring: bytes
           ) -> tuple[list[tuple[str, str, str]], int]:
    """One base's packages into `repo`: the .debs, their Packages index, and the apt
    configuration RUN steps use. Returns the packages (name, version, arch) and bytes."""
    # one cache per release and keyring: lists one set of keys accepted never serve another
    cache = aptcache.cache_root() / f"{release.name}-{hashlib.sha256(keyring).hexdigest()[:12]}"
    archives = cache / "archives"
    (cache / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "empty").mkdir(parents=True)
    (scratch / "status").write_bytes(status)
    proxy = os.environ.get("CAMPUGRID_APT_PROXY", "")
    through = mirror.url if mirror is not None and not proxy else ""
    (scratch / "sources.list").write_text(release.sources(through))
    auth = scratch / "auth.conf"  # the mirror token, as apt sends a password (0600)
    with os.fdopen(os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        if through and mirror is not None:
            # apt gives a machine without a scheme its password over https only
            machine = through if through.startswith("http:") else through.split("://", 1)[1]
            f.write(f"machine {machine}\nlogin campugrid\npassword {mirror.token}\n")
    if through and mirror is not None and mirror.certificate:
        (scratch / "coordinator.pem").write_text(mirror.certificate)
    keys = scratch / "keys"
    keys.mkdir()
    (keys / KEYRINGS[release.distro]).write_bytes(keyring)
    config = scratch / "apt.conf"
    config.write_text(_host_config(release, cache, scratch))
    env = {**os.environ, "APT_CONFIG": str(config), "LC_ALL": "C"}
    log(f"[campugrid] fetching Debian packages for {release.distro} {release.codename} "
        f"({release.arch}) from {MIRRORS[release.distro][0]}"
        + (f" through {proxy}" if proxy else
           f" through the platform's cache at {through}" if through else ""))
    with aptcache.locked(cache / "lock"):
        _update(release, cache, (scratch / "sources.list").read_text(), env, log, stop)
        wanted: dict[str, tuple[str, str, str]] = {}  # file name -> (name, version, arch)
        commands = ([["dist-upgrade"]] if upgrade else []) + (
            [["install", *([] if recommends else ["--no-install-recommends"]), *packages]]
            if packages else [])
        plan = aptcache.plan_file(cache, status, commands)
        before = aptcache.planned_before(plan)
        if before is not None:
            wanted, records = before
            log(f"[campugrid] apt's plan for these packages, made from the same lists and "
                f"dpkg status {time.time() - plan.stat().st_mtime:.0f} s ago: used again")
        else:
            for command in commands:
                wanted |= _planned(command, env, release)
            records = _records(list(wanted.values()), env)
        size = sum(int(m[1]) for r in records if (m := re.search(r"^Size: (\d+)$", r, re.M)))
        if size > budget:
            raise BuildFailed(f"the build's Debian packages take {size // 1024**2} MB, more "
                              "than is left of resources.disk_mb", "")
        # apt takes a kept .deb of the right size as it is: one that is not as its record
        # says goes, and apt fetches it again
        cached = aptcache.kept(wanted, records, archives)
        if before is None or len(cached) < len(wanted):
            for command in commands:
                _apt(["apt-get", "--download-only", "--yes", *command], env, log, stop, release)
            aptcache.kept(wanted, records, archives)  # what apt fetched, checked once and noted
            aptcache.remember_plan(plan, wanted, records)
        repo.mkdir(parents=True)
        for name in wanted:
            aptcache.link(archives / name, repo / name)
        aptcache.trim(archives, log)
    (repo / "Packages").write_text("\n\n".join(
        re.sub(r"^Filename: .*/", "Filename: ./", r, flags=re.M) for r in records) + "\n")
    (repo / "empty").mkdir()
    (repo / "sources.list").write_text(f"deb [trusted=yes] file:{IN_BUILD}/{repo.name} ./\n")
    (repo / "apt.conf").write_text(
        f'Dir::Etc::SourceList "{IN_BUILD}/{repo.name}/sources.list";\n'
        f'Dir::Etc::SourceParts "{IN_BUILD}/{repo.name}/empty";\n'
        'Acquire::Languages "none";\nDpkg::Use-Pty "0";\n')
    for name in sorted(wanted):
        pkg, version, arch = wanted[name]
        log(f"[campugrid] deb {pkg} {version} {arch} {(repo / name).stat().st_size / 1024:.0f} kB"
            f" ({'cached' if name in cached else 'fetched'})")
    log(f"[campugrid] staged {len(wanted)} Debian packages, {size / 1024**2:.1f} MB "
        f"({len(cached)} from this machine's cache) for {release.codename}; RUN steps install "
        "them offline")
    return list(wanted.values()), size


def _update(release: Release, cache: Path, sources: str, env: dict[str, str], log: LogFn,
            stop: threading.Event | None) -> None:
    """apt-get update, unless the last one (for these same sources: another's removes their
    lists) ended less than LISTS_FRESH_S ago."""
    marker = cache / aptcache.MARKER
    digest = hashlib.sha256(sources.encode()).hexdigest()
    with contextlib.suppress(OSError):
        age = time.time() - marker.stat().st_mtime
        if 0 <= age < LISTS_FRESH_S and marker.read_text() == digest:
            log(f"[campugrid] apt's lists for {release.codename} were fetched {age:.0f} s ago "
                f"(at most every {LISTS_FRESH_S // 60} minutes): not fetched again")
            return
    marker.unlink(missing_ok=True)
    aptcache.drop_plans(cache)  # made from the lists about to change
    _apt(["apt-get", "update"], env, log, stop, release)
    marker.write_text(digest)


def _host_config(release: Release, cache: Path, scratch: Path) -> str:
    """apt as this user, on private folders: the image's status, our sources and keys only
    (none of the host's apt configuration), no locks on the host's dpkg."""
    proxy = os.environ.get("CAMPUGRID_APT_PROXY")
    pem = scratch / "coordinator.pem"
    settings = {
        "Dir::State::lists": cache / "lists", "Dir::State::status": scratch / "status",
        "Dir::State::extended_states": scratch / "extended_states",
        "Dir::Cache::archives": cache / "archives", "Dir::Etc::main": scratch / "empty" / "none",
        # apt's parsed lists, kept between its calls (1.8 s of 5.5 for one package): the
        # lists alone per release, which apt checks against their files; with this image's
        # dpkg status, per build
        "Dir::Cache::srcpkgcache": cache / "srcpkgcache.bin",
        "Dir::Cache::pkgcache": scratch / "pkgcache.bin",
        "Dir::Etc::SourceList": scratch / "sources.list",
        "Dir::Etc::SourceParts": scratch / "empty", "Dir::Etc::Parts": scratch / "empty",
        "Dir::Etc::Preferences": scratch / "empty" / "none",
        "Dir::Etc::PreferencesParts": scratch / "empty",
        "Dir::Etc::TrustedParts": scratch / "keys", "Dir::Etc::Trusted": scratch / "empty" / "x",
        "Dir::Log": scratch / "log", "Debug::NoLocking": "true", "APT::Sandbox::User": "",
        "APT::Architecture": release.arch, "Acquire::Languages": "none",
        "Acquire::Retries": "3", "Acquire::http::Proxy": proxy or "DIRECT",
        "Acquire::https::Proxy": "DIRECT", "Dir::Etc::netrc": scratch / "auth.conf",
        "Dir::Etc::netrcparts": scratch / "empty",
        **({"Acquire::https::CAInfo": pem} if pem.exists() else {}),
    }
    return "".join(f'{k} "{v}";\n' for k, v in settings.items()) + \
        f'APT::Architectures {{ "{release.arch}"; }};\n'


def _apt(argv: list[str], env: dict[str, str], log: LogFn, stop: threading.Event | None,
         release: Release) -> None:
    done = run_streaming(["env", f"APT_CONFIG={env['APT_CONFIG']}", "LC_ALL=C", *argv],
                         log=lambda line: log(f"[apt] {line}"), timeout_s=APT_TIMEOUT_S,
                         cancel=stop, tail_lines=60)
    if done.cancelled:
        raise BuildFailed("stopped while fetching Debian packages", "")
    if done.returncode == 0 and not done.timed_out and "\nW: Failed to fetch" not in done.tail:
        return
    _fail(done.tail, release, done.timed_out)


def _planned(command: list[str], env: dict[str, str], release: Release
             ) -> dict[str, tuple[str, str, str]]:
    """What apt would install (`--simulate`): each package's .deb file name in the archive,
    and its name, version and architecture."""
    out = subprocess.run(["apt-get", "--simulate", "--yes", *command], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        _fail(out.stdout + out.stderr, release, False)
    found = {}
    for name, version, arch in re.findall(r"^Inst (\S+) (?:\[[^]]*\] )?\((\S+) .*?\[(\S+)\]\)",
                                          out.stdout, re.M):
        name = name.partition(":")[0]
        found[f"{name}_{version.replace(':', '%3a')}_{arch}.deb"] = (name, version, arch)
    return found


def _records(packages: list[tuple[str, str, str]], env: dict[str, str]) -> list[str]:
    """apt's own index records of these exact packages (the mirror's Packages entries)."""
    if not packages:
        return []
    out = subprocess.run(["apt-cache", "show", "--no-all-versions",
                          *[f"{n}:{a}={v}" for n, v, a in packages]], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    records, seen = [], set()
    for record in out.stdout.strip().split("\n\n"):
        key = (re.search(r"^Package: (\S+)", record, re.M), re.search(r"^Version: (\S+)",
                                                                     record, re.M))
        ident = tuple(m[1] if m else "" for m in key)
        if ident not in seen:  # the same version in two suites: one record
            seen.add(ident)
            records.append(record.strip())
    return records


def _fail(tail: str, release: Release, timed_out: bool) -> None:
    missing = [m for pattern in _MISSING for m in pattern.findall(tail)]
    if missing:
        raise BuildFailed(
            f"Debian package {', '.join(dict.fromkeys(missing))}: not in {release.distro} "
            f"{release.codename} (main, updates, security) for {release.arch}. Check the "
            "name and version, or build on a base of the release that has it", tail[-2000:])
    if "held broken packages" in tail or "but it is not going to be installed" in tail:
        raise BuildFailed(f"the declared Debian packages cannot be installed together on this "
                          f"base ({release.codename}); see apt's explanation", tail[-2000:])
    if timed_out or _NETWORK.search(tail):
        raise SandboxError(f"cannot fetch Debian packages for {release.codename} (this "
                           "machine's network or the mirror)", stderr_tail=tail[-2000:])
    raise SandboxError("apt-get failed fetching Debian packages (see the build log)",
                       stderr_tail=tail[-2000:])


def explain(failure: BuildFailed, staged: Staged | None) -> BuildFailed:
    """A build whose RUN step's apt-get found no package: say which, and how to declare it."""
    found = [m for pattern in _MISSING for m in pattern.findall(failure.log_tail)]
    if not found:
        return failure
    names = ", ".join(dict.fromkeys(found))
    if staged is not None and all(name.partition("=")[0] in staged.names for name in found):
        return BuildFailed(
            f"a RUN step's apt found no {names}, which was fetched for it: run `apt-get "
            "update` before `apt-get install`, in the same RUN step (as on any image whose "
            f"package lists are empty). ({failure.reason})", failure.log_tail)
    where = "was not declared" if staged is not None else "cannot be fetched: this build " \
        "declared no Debian packages"
    return BuildFailed(
        f"a RUN step installs {names} with apt, which {where}; RUN steps have no network and "
        "install only the packages fetched before the build. Declare it: name it on an "
        "`apt-get install` line, or list it in the spec's build.apt. "
        f"({failure.reason})", failure.log_tail)
