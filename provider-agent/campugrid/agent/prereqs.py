"""What a machine needs before it can lend itself, each checked and, where missing, explained
in plain words with the command that fixes it (and whether that command needs root).

`campugrid provider install` runs these; `root_step` turns the root-only fixes into one
script the owner reads and consents to. The agent itself never runs any of it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pwd
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from campugrid.agent.gpus import nvml_text
from campugrid.buildpolicy.dockerfiles import allowed_bases
from campugrid.sandbox.limits import delegated_subtree as v1_subtree

PACKAGES = ("podman", "runsc", "uidmap", "slirp4netns")
MIN_SUBIDS = 65536
RUNSC_FAST = "20240729"  # systrap and directfs; Debian 12's own runsc (20221219) has neither
# gVisor built from its Go module at the commit campugrid is tested on (infra/setup.sh runs it;
# the root step does where Go is present): its `stamp=` line is the pin.
RUNSC_FROM_GO = Path(__file__).with_name("runsc-from-go.sh")
BUILD_RUNSC = f"bash {shlex.quote(str(RUNSC_FROM_GO))}"  # the root step's line that runs it
MIN_FREE_GB = 10
CGROUP = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
LINGER = Path("/var/lib/systemd/linger")
Run = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    found: str  # what is there, in words
    fix: str = ""  # what to do about it: a command, or words
    root: bool = False  # the fix must run as root (it goes into the consented root step)
    blocking: bool = True  # without it no job can run here

    @property
    def line(self) -> str:
        mark = "ok " if self.ok else ("!! " if self.blocking else "-- ")
        return f"{mark}{self.name:<18} {self.found}" + (f"\n{'':22}fix: {self.fix}" if self.fix else "")


@dataclasses.dataclass(frozen=True)
class Host:
    """Where the checks look (the real machine unless a test says otherwise)."""

    user: str
    home: Path
    cgroup: Path = CGROUP
    subuid: Path = Path("/etc/subuid")
    subgid: Path = Path("/etc/subgid")
    linger: Path = LINGER
    systemd: Path = Path("/run/systemd/system")  # there when systemd runs the machine
    run: Run = subprocess.run
    which: Callable[[str], str | None] = shutil.which

    @classmethod
    def this_user(cls) -> Host:
        pw = pwd.getpwuid(os.geteuid())
        return cls(pw.pw_name, Path(pw.pw_dir))

    @classmethod
    def of(cls, user: str) -> Host:
        pw = pwd.getpwnam(user)
        return cls(pw.pw_name, Path(pw.pw_dir))

    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    def output(self, argv: Sequence[str], timeout: float = 30) -> tuple[int, str]:
        try:
            out = self.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            return 127, str(e)
        return int(out.returncode), (out.stdout or "") + (out.stderr or "")


def check_all(host: Host, state_dir: Path, nvml: Any = None) -> list[Check]:
    checks = [podman(host), runsc(host), subids(host, host.subuid, "subuid"),
              subids(host, host.subgid, "subgid"), storage(host), cgroups(host), lingering(host),
              disk(state_dir), base_images(host), skopeo(host)]
    checks += gpus(host, nvml)
    return checks


def podman(host: Host) -> Check:
    if host.which("podman") is None:
        return Check("podman", False, "not installed: it runs each job's container",
                     "apt-get install " + " ".join(PACKAGES), root=True)
    code, text = host.output(["podman", "--version"])
    return Check("podman", code == 0, text.strip() or "does not start",
                 "" if code == 0 else "reinstall it: apt-get install --reinstall podman", root=code != 0)


def runsc(host: Host) -> Check:
    """gVisor's runsc: there, and where Go is here, the one campugrid is tested on (built by
    the root step from gVisor's Go module, once)."""
    build = build_runsc(host)
    if host.which("runsc") is None:
        return Check("runsc (gVisor)", False, "not installed: every job runs inside gVisor, "
                     "so nothing can run without it", build or "apt-get install runsc", root=True)
    code, text = host.output(["runsc", "--version"])
    version = text.strip().splitlines()[0] if text.strip() else "?"
    if code != 0:
        return Check("runsc (gVisor)", False, version)
    dated, pinned = runsc_date(version), pinned_runsc()
    if build and dated and dated < (runsc_date(pinned) or ""):
        return Check("runsc (gVisor)", False, f"{version}: older than gVisor {pinned}, the one "
                     "campugrid is tested on (newer GPU drivers under nvproxy, faster systrap)",
                     build, root=True, blocking=False)
    if dated and dated < RUNSC_FAST:
        return Check("runsc (gVisor)", False, f"{version}: only the ptrace platform, so Python in "
                     "jobs and builds runs about 1.4x slower than on a runsc from 2024",
                     "install Go 1.26 and run `campugrid provider prepare` again: it builds "
                     f"gVisor {pinned} from gVisor's Go module; or, on Debian 12, enable "
                     "bookworm-backports and apt-get install -t bookworm-backports runsc; "
                     "elsewhere, gVisor's own apt repository",
                     blocking=False)
    return Check("runsc (gVisor)", True, version)


def build_runsc(host: Host) -> str:
    """The root step's command that builds the pinned runsc, where Go is here ("" if not)."""
    if host.which("go") is None and host.which("/usr/local/go/bin/go") is None:
        return ""
    return BUILD_RUNSC


def pinned_runsc(script: Path = RUNSC_FROM_GO) -> str:
    """The stamp of the runsc that runsc-from-go.sh builds ("go-20260905-160fafc42237")."""
    found = re.search(r"^stamp=(\S+)$", script.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{script} names no stamp")
    return found.group(1)


def runsc_date(version: str) -> str | None:
    """The release date in `runsc --version`'s words ("0.0~20240729.0", "release-20240729.0",
    runsc-from-go.sh's "go-20260905-160fafc42237")."""
    found = re.search(r"\b(20\d{6})\b", version)
    return found.group(1) if found else None


def subids(host: Host, path: Path, kind: str) -> Check:
    """Rootless containers map their users onto a range of ids the owner's user may use."""
    count = 0
    try:
        for line in path.read_text().splitlines():
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[0] in (host.user, str(_uid_or(host))) and parts[2].isdigit():
                count += int(parts[2])
    except OSError:
        pass
    flag = "--add-subuids" if kind == "subuid" else "--add-subgids"
    if count >= MIN_SUBIDS:
        return Check(f"{kind} range", True, f"{count} ids for {host.user}")
    return Check(f"{kind} range", False,
                 f"{host.user} has {count} subordinate ids in {path}; containers need "
                 f"{MIN_SUBIDS}", f"usermod {flag} (a free range of {MIN_SUBIDS}) {host.user}",
                 root=True)


def _uid_or(host: Host) -> int | str:
    try:
        return host.uid()
    except KeyError:
        return ""


def storage(host: Host) -> Check:
    """vfs copies every image layer: starts take seconds instead of a quarter of one."""
    code, text = host.output(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], 60)
    driver = text.strip().splitlines()[-1] if code == 0 and text.strip() else ""
    if driver == "overlay":
        return Check("storage driver", True, "overlay")
    conf = host.home / ".config/containers/storage.conf"
    return Check("storage driver", False,
                 f"{driver or 'unknown'}: jobs start slowly (every layer is copied)",
                 f"printf '[storage]\\ndriver = \"overlay\"\\n' > {conf} && podman system reset "
                 "--force (as yourself; this deletes your podman images)", blocking=False)


def cgroups(host: Host) -> Check:
    """Memory, CPU and process limits hold only where the kernel's cgroups are delegated to
    this user: cgroup v2 through systemd, v1 through a subtree root hands over."""
    if (host.cgroup / "cgroup.controllers").exists():
        uid = _uid_or(host)
        mine = host.cgroup / f"user.slice/user-{uid}.slice/user@{uid}.service/cgroup.controllers"
        try:
            have = set(mine.read_text().split())
        except OSError:
            have = set()
        if set(CONTROLLERS) <= have:
            return Check("cgroup limits", True, "cgroup v2, delegated by systemd")
        return Check("cgroup limits", False,
                     f"cgroup v2 without {', '.join(sorted(set(CONTROLLERS) - have))} delegated to "
                     f"{host.user}: job memory, CPU and process limits would not hold",
                     "a systemd drop-in Delegate=cpu cpuset io memory pids for user@.service",
                     root=True, blocking=False)
    subtree = v1_subtree(host.user)
    missing = [c for c in CONTROLLERS
               if not (host.cgroup / c / subtree).is_dir()
               or _owner(host.cgroup / c / subtree) != _uid_or(host)]
    if not missing:
        return Check("cgroup limits", True, f"cgroup v1, {subtree}/ delegated")
    return Check("cgroup limits", False,
                 f"cgroup v1 and no {subtree}/ subtree for {', '.join(missing)}: job memory, "
                 "CPU and process limits would not hold",
                 f"mkdir and chown /sys/fs/cgroup/{{memory,cpu,pids}}/{subtree} to {host.user}",
                 root=True, blocking=False)


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None


def lingering(host: Host) -> Check:
    """Without lingering, systemd stops the user's agent when they log out."""
    if not host.systemd.is_dir():
        return Check("lingering", True, "no systemd here: run the agent in the foreground "
                     "(install says how)", blocking=False)
    if (host.linger / host.user).exists():
        return Check("lingering", True, "on: the agent keeps running when you log out")
    return Check("lingering", False, "off: the agent would stop when you log out",
                 f"loginctl enable-linger {host.user}", root=True, blocking=False)


def disk(state_dir: Path) -> Check:
    where = state_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free_gb = shutil.disk_usage(where).free / 1024**3
    ok = free_gb >= MIN_FREE_GB
    return Check("free disk", ok, f"{free_gb:.0f} GiB free at {where}",
                 "" if ok else f"free at least {MIN_FREE_GB} GiB there (images and job outputs "
                 "go there)", blocking=False)


def base_images(host: Host, bases: Sequence[str] | None = None) -> Check:
    """The allowed bases (CAMPUGRID_ALLOWED_BASES) that jobs build FROM without a registry.
    A machine without one hands such jobs back to the queue (CannotRunHere): they go to the
    machines that have it, so this is a warning, not a stop."""
    names = list(bases) if bases is not None else [b.name for b in allowed_bases()]
    missing = [n for n in names if host.output(["podman", "image", "exists", n], 60)[0] != 0]
    if not missing:
        return Check("base images", True, ", ".join(names))
    return Check("base images", False,
                 f"{', '.join(missing)} missing: jobs built FROM it go to other machines",
                 f"infra/base-image.sh {host.user} (from the campugrid repository; as root it "
                 "also makes the image's root file system), or `podman load` of a copy",
                 blocking=False)


def skopeo(host: Host) -> Check:
    """skopeo pulls the bases that Dockerfiles name on registries (agent/bases.py)."""
    if host.which("skopeo"):
        return Check("skopeo", True, "pulls base images from registries")
    return Check("skopeo", False, "not installed: jobs whose Dockerfile starts FROM an image "
                 "on a registry go to other machines", "apt-get install -y skopeo", root=True,
                 blocking=False)


def gpus(host: Host, nvml: Any = None) -> list[Check]:
    """NVML, and whether this runsc can hand this driver's GPUs to gVisor: gVisor supports
    an exact list of driver versions and crashes with only "EOF" on any other."""
    try:
        nvml = nvml or importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as e:
        return [Check("NVIDIA GPUs", True, f"none found ({type(e).__name__.removeprefix('NVMLError_')}): "
                      "CPU jobs only", blocking=False)]
    try:
        driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()
    found = Check("NVIDIA GPUs", True, f"{count} GPU(s), driver {driver}")
    code, text = host.output(["runsc", "flags"])
    if "nvproxy" not in text:
        return [found, Check("GPU in gVisor", False, "this runsc cannot pass GPUs into gVisor "
                             "(no nvproxy): GPU jobs will not come here",
                             "install a newer runsc from gVisor's releases", root=True,
                             blocking=False)]
    code, text = host.output(["runsc", "nvproxy", "list-supported-drivers"])
    supported = {line.strip() for line in text.splitlines() if line.strip()}
    if code != 0:
        return [found, Check("GPU in gVisor", False, f"cannot ask this runsc which drivers it "
                             f"supports ({text.strip()[:120]})", "install a newer runsc",
                             root=True, blocking=False)]
    if driver not in supported:
        return [found, Check("GPU in gVisor", False,
                             f"this runsc does not support driver {driver} (it supports "
                             f"{', '.join(sorted(supported)[-4:])}, ...); gVisor would crash "
                             "with only 'EOF'", "install a driver version on that list, or a "
                             "runsc that lists yours", root=True, blocking=False)]
    return [found, Check("GPU in gVisor", True, f"nvproxy supports driver {driver}")]


USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")  # Debian's adduser default


def check_user(user: str) -> str:
    """A user name the root step may name: it goes into a script root runs."""
    if not USER_NAME.match(user):
        raise ValueError(f"user name {user!r}: the root step handles names of a-z, 0-9, '_' "
                         "and '-' only (up to 32, starting with a letter or '_')")
    return user


def free_range(*files: Path, size: int = MIN_SUBIDS, start: int = 100000) -> int:
    """The first id at or after `start`, on a multiple of `size`, that no range in these
    files (/etc/subuid, /etc/subgid) overlaps: two providers never share container ids."""
    taken: list[tuple[int, int]] = []
    for path in files:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                taken.append((int(parts[1]), int(parts[1]) + int(parts[2])))
    first = start
    while any(lo < first + size and first < hi for lo, hi in taken):
        first += size
    return first


def root_step(user: str, checks: Sequence[Check], cgroup: Path = CGROUP,
              subuid: Path = Path("/etc/subuid"), subgid: Path = Path("/etc/subgid")) -> str:
    """The one script, for the owner to read and run as root, that fixes what needs root."""
    who = shlex.quote(check_user(user))
    wanted = {c.name for c in checks if not c.ok and c.root}
    # runsc: Debian's package, or (where Go is here) the one built from gVisor's Go module
    built = [c.fix for c in checks if not c.ok and c.fix == BUILD_RUNSC]
    lines: list[str] = []
    if "podman" in wanted or ("runsc (gVisor)" in wanted and not built):
        lines.append("apt-get install -y " + " ".join(PACKAGES)
                     + (" skopeo" if "skopeo" in wanted else ""))
    elif "skopeo" in wanted:
        lines.append("apt-get install -y skopeo")
    lines += built
    if wanted & {"subuid range", "subgid range"}:
        first = free_range(subuid, subgid)
        span = f"{first}-{first + MIN_SUBIDS - 1}"
        for kind, flag in (("subuid", "--add-subuids"), ("subgid", "--add-subgids")):
            if f"{kind} range" in wanted:
                lines.append(f"usermod {flag} {span} {who}")
    if "cgroup limits" in wanted:
        if (cgroup / "cgroup.controllers").exists():
            lines += ["mkdir -p /etc/systemd/system/user@.service.d",
                      "printf '[Service]\\nDelegate=cpu cpuset io memory pids\\n' > "
                      "/etc/systemd/system/user@.service.d/delegate.conf",
                      "systemctl daemon-reload"]
        else:
            for c in CONTROLLERS:
                path = shlex.quote(str(cgroup / c / v1_subtree(user)))
                lines += [f"mkdir -p {path}", f"chown -R {who}: {path}"]
    if "lingering" in wanted:
        lines.append(f"loginctl enable-linger {who}")
    return "\n".join(["set -eu", *lines]) + "\n" if lines else ""


def undo_root_step(user: str, cgroup: Path = CGROUP) -> str:
    """What uninstall undoes as root: the cgroup subtree (with whatever cgroups are left in
    it) and lingering. Packages and id ranges stay: other programs may use them."""
    who = shlex.quote(check_user(user))
    lines = ["set -u"]
    if not (cgroup / "cgroup.controllers").exists():
        for c in CONTROLLERS:
            path = shlex.quote(str(cgroup / c / v1_subtree(user)))
            lines.append(f"[ ! -d {path} ] || find {path} -depth -type d -exec rmdir {{}} +")
    lines.append(f"loginctl disable-linger {who} 2>/dev/null || rm -f {LINGER}/{who}")
    return "\n".join(lines) + "\n"
