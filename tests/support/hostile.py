"""Host-side evidence that a hostile job (or build) left the provider's machine as it found it.

Take a `snapshot()` before the attack and one after, and `assert_host_unaffected(before,
after)`: the provider user's processes, listening sockets, the per-job cgroups under the
delegated cgroup subtree, free disk where the agent keeps its state, planted canary
files, and the provider's podman containers. Other work on the same machine (other tests'
agents and sandboxes, run by the same provider user) is told apart with a `Scope`, so that only
what belongs to the platform under test is blamed. `wait_host_unaffected` polls until the
agent's own clean-up after a job has finished, or fails with the last difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from campugrid.cli.platform import ProviderUser
from campugrid.sandbox.limits import delegated_subtree

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CONTROLLERS = ("memory", "pids", "cpu")
# Processes of the provider user that are not any job's: rootless podman's pause process,
# and the build runtime's background `runsc delete` (it finishes a few seconds after a build
# step; one older than this is a leftover, not a helper in flight).
TRANSIENT_HELPER_S = 60.0
_PAUSE = re.compile(r"^(podman|catatonit -P|podman pause)$")
_RUNSC_DELETE = re.compile(r"^\S*runsc\b.* delete\b")
_CONMON_NAME = re.compile(r"(?:^|\s)(?:-n|--name)\s+(\S+)")
# The agent's own upkeep between tasks (removing a sandbox, its image, sweeping): tools it
# runs, not anything of a job. `podman ... run` is not among them: a sandbox still running is.
AGENT_UPKEEP = re.compile(
    r"^\S*(?:podman|buildah)\s+(?:rmi|images|ps|rm|kill|container\s+exists|image\s+exists|"
    r"unshare\s+rm|info|version)\b|^\S*runsc\s+--version\b")


# --- what one snapshot holds -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    start: int  # clock ticks after boot: with the pid, names one process for good
    cmdline: str
    state: str = "R"  # as in /proc/PID/stat: Z for a zombie (exited, not yet reaped)

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid}, parent {self.ppid}): {self.cmdline[:200]}"


@dataclasses.dataclass(frozen=True)
class Listener:
    proto: str  # tcp, tcp6, udp, udp6
    address: str
    port: int
    uid: int

    def __str__(self) -> str:
        return f"{self.proto} {self.address}:{self.port} (uid {self.uid})"


@dataclasses.dataclass(frozen=True)
class FileState:
    exists: bool
    size: int = -1
    mtime_ns: int = -1
    sha256: str = ""

    @classmethod
    def of(cls, path: Path) -> FileState:
        try:
            st = path.lstat()
            data = path.read_bytes()
        except OSError:
            return cls(False)
        return cls(True, st.st_size, st.st_mtime_ns, hashlib.sha256(data).hexdigest())


@dataclasses.dataclass(frozen=True)
class Canary:
    """A file with a random token, planted where a job must never read or change it."""

    path: Path
    token: str

    @classmethod
    def plant(cls, path: Path, owner: ProviderUser | None = None, *, label: str = "") -> Canary:
        """Owned by the provider (mode 0600) when given: readable by the job's uid if the
        sandbox ever let it see the path, so a read that fails proves the sandbox held."""
        token = f"campugrid-canary-{label}-{secrets.token_hex(16)}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
        if owner is not None and os.geteuid() == 0:
            os.chown(path, owner.uid, owner.gid)
        return cls(path, token)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    taken_at: float  # time.time()
    uids: frozenset[int]  # the provider's uid and its subordinate uids
    procs: Mapping[int, Proc]  # every process on the host (ancestry needs the others too)
    listeners: frozenset[Listener]  # the provider's (uids above) listening sockets
    cgroups: Mapping[str, frozenset[str]]  # controller -> paths of cgroups below `subtree`
    disk_path: Path
    free_bytes: int
    files: Mapping[Path, FileState]  # canaries and other watched files
    containers: frozenset[str]  # the provider's podman containers, by name
    subtree: str  # the provider's delegated cgroup folder (its name below each controller)

    def provider_procs(self) -> dict[tuple[int, int], Proc]:
        return {p.key: p for p in self.procs.values() if p.uid in self.uids}


@dataclasses.dataclass
class Scope:
    """What belongs to the platform under test. Things that belong to someone else on the same
    machine are never blamed: processes started (through runuser) by another process than
    `own_pids`, and containers and cgroups whose name holds none of `tokens` (the ids of this
    platform's jobs, which the agent puts into both). `tokens=None`: everything is ours."""

    own_pids: set[int] = dataclasses.field(default_factory=lambda: {os.getpid()})
    tokens: set[str] | None = None

    def owns_name(self, name: str) -> bool:
        return self.tokens is None or any(t in name for t in self.tokens)


# --- taking one -----------------------------------------------------------------------------

def provider_uids(user: ProviderUser) -> frozenset[int]:
    """The provider's uid and the subordinate uids its rootless containers run as."""
    uids = {user.uid}
    with contextlib.suppress(OSError):
        for line in Path("/etc/subuid").read_text().splitlines():
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[0] in (user.name, str(user.uid)):
                start, count = int(parts[1]), int(parts[2])
                uids.update(range(start, start + count))
    return frozenset(uids)


def processes() -> dict[int, Proc]:
    out: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            status = Path(f"/proc/{entry}/status").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)
        cmdline = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        if not cmdline:  # a kernel thread, or a zombie
            cmdline = "[" + stat[stat.index("(") + 1:stat.rindex(")")] + "]"
        out[int(entry)] = Proc(int(entry), int(fields[1]), uid, int(fields[19]), cmdline, fields[0])
    return out


def listening_sockets() -> frozenset[Listener]:
    """TCP sockets in LISTEN and unconnected bound UDP sockets, from /proc/net (the host's
    network namespace: we run in it)."""
    found = set()
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote, state, uid = f[1], f[2], f[3], int(f[7])
            listening = state == "0A" if proto.startswith("tcp") else (
                state == "07" and remote.rsplit(":", 1)[1] == "0000")
            if listening:
                addr, port = local.rsplit(":", 1)
                found.add(Listener(proto, _address(addr), int(port, 16), uid))
    return frozenset(found)


def _address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1].hex() for i in range(0, 16, 4)]
    return ":".join(w[j:j + 4] for w in words for j in (0, 4))


def delegated(user: ProviderUser, ctrl: str) -> Path:
    """The cgroup folder root delegated to the provider user for one controller."""
    return CGROUP_ROOT / ctrl / delegated_subtree(user.name)


@contextlib.contextmanager
def cpu_stats(user: ProviderUser) -> Iterator[dict[str, dict[str, int]]]:
    """While the block runs, the kernel's own account of every cgroup below the provider's
    delegated cpu folder (cpu.stat: nr_periods, nr_throttled, throttled_time; and its quota
    and period), read every 0.1 s, each as last read, keyed by its path below that folder.
    What a CPU cap did, whatever else loads the host (loop counts move with that too)."""
    seen: dict[str, dict[str, int]] = {}
    ended = threading.Event()
    base = delegated(user, "cpu")

    def watch() -> None:
        while not ended.wait(0.1):
            for stat in base.rglob("cpu.stat"):
                try:
                    got = {k: int(v) for k, v in (line.split() for line in
                                                  stat.read_text().splitlines())}
                    got["quota"] = int((stat.parent / "cpu.cfs_quota_us").read_text())
                    got["period"] = int((stat.parent / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue  # gone as it was read
                seen[str(stat.parent.relative_to(base))] = got

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        ended.set()
        watcher.join(timeout=10)


def cgroup_children(user: ProviderUser) -> dict[str, frozenset[str]]:
    """Every cgroup below each controller's folder delegated to the provider user, as
    relative paths (agents nest job cgroups under a folder of their own:
    `a-<scope>/campugrid-<job>-1`)."""
    out: dict[str, frozenset[str]] = {}
    for ctrl in CGROUP_CONTROLLERS:
        base = delegated(user, ctrl)
        names = set()
        for dirpath, dirnames, _files in os.walk(base):
            for d in dirnames:
                names.add(str(Path(dirpath, d).relative_to(base)))
        out[ctrl] = frozenset(names)
    return out


def podman_containers(user: ProviderUser) -> frozenset[str]:
    proc = subprocess.run(user.command(["podman", "ps", "-a", "--format", "{{.Names}}"]),
                          capture_output=True, text=True, timeout=60, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"podman ps failed for {user.name}: {proc.stderr[-500:]}")
    return frozenset(proc.stdout.split())


def snapshot(user: ProviderUser, *, disk_path: Path,
             watch: Iterable[Path | Canary] = ()) -> HostSnapshot:
    """The host as the provider's agent sees it, and the watched files' contents."""
    paths = [w.path if isinstance(w, Canary) else w for w in watch]
    return HostSnapshot(
        taken_at=time.time(), uids=provider_uids(user), procs=processes(),
        listeners=frozenset(s for s in listening_sockets() if s.uid in provider_uids(user)),
        cgroups=cgroup_children(user), disk_path=disk_path,
        free_bytes=shutil.disk_usage(disk_path).free,
        files={p: FileState.of(p) for p in paths}, containers=podman_containers(user),
        subtree=delegated_subtree(user.name))


# --- comparing two --------------------------------------------------------------------------

def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def _age_s(proc: Proc, now: float) -> float:
    return now - (_boot_time() + proc.start / os.sysconf("SC_CLK_TCK"))


def _owner(proc: Proc, snap: HostSnapshot, scope: Scope) -> str:
    """'ours', 'helper' or who else it belongs to, by its ancestry in `snap`."""
    if AGENT_UPKEEP.match(proc.cmdline):  # in flight, whoever runs it
        return "helper"
    top = proc  # the topmost provider-owned ancestor
    started_by: Proc | None = None  # the first non-provider ancestor (runuser, say)
    node, seen = proc, set()
    while node.pid not in seen:
        seen.add(node.pid)
        if node.pid in scope.own_pids:
            return "ours"  # e.g. our agent, under the runuser our test process started
        parent = snap.procs.get(node.ppid)
        if node.ppid in (0, 1) or parent is None:
            break
        if parent.uid in snap.uids and started_by is None:
            top = parent
        elif parent.uid not in snap.uids and started_by is None:
            started_by = parent
        node = parent
    if started_by is not None:  # another test run's runuser: not ours to blame
        return f"someone else's (started under {started_by})"
    # An orphan tree (conmon, a daemon that left its parent): name what it belongs to.
    if _PAUSE.match(top.cmdline):
        return "helper"
    if _RUNSC_DELETE.match(proc.cmdline) and _age_s(proc, snap.taken_at) < TRANSIENT_HELPER_S:
        return "helper"
    named = _CONMON_NAME.search(top.cmdline) if "conmon" in top.cmdline else None
    if named and not scope.owns_name(named.group(1)):
        return f"someone else's (container {named.group(1)})"
    return "ours"


def differences(before: HostSnapshot, after: HostSnapshot, *, scope: Scope | None = None,
                ignore_build_cgroups: bool = False, disk_slack_mb: int = 512) -> list[str]:
    """What changed on the host between two snapshots, one sentence each ([] = nothing)."""
    scope = scope or Scope()
    problems: list[str] = []
    old = before.provider_procs()
    for key, proc in sorted(after.provider_procs().items()):
        if key in old or proc.state == "Z":  # a zombie has exited: it holds nothing but a pid
            continue
        owner = _owner(proc, after, scope)
        if owner == "ours":
            problems.append(f"a new process of the provider user remains: {proc}")
    for sock in sorted(after.listeners - before.listeners, key=str):
        problems.append(f"a new listening socket of the provider user: {sock}")
    for ctrl, names in after.cgroups.items():
        for name in sorted(names - before.cgroups.get(ctrl, frozenset())):
            leaf = name.rsplit("/", 1)[-1]
            if ignore_build_cgroups and leaf.startswith("build-"):
                continue
            if not scope.owns_name(name):
                continue
            if "/" not in name and leaf.startswith("a-") and not any(
                    n.startswith(name + "/") for n in names):
                continue  # an agent's (empty) folder for its job cgroups, not a job's
            problems.append(f"a cgroup was left behind: "
                            f"{CGROUP_ROOT / ctrl / after.subtree / name}")
    lost = before.free_bytes - after.free_bytes
    if lost > disk_slack_mb * 1024 * 1024:
        problems.append(f"free disk on {after.disk_path} fell by {lost / 1024**2:.0f} MiB "
                        f"(slack {disk_slack_mb} MiB)")
    for path, was in before.files.items():
        now = after.files.get(path, FileState(False))
        if now != was:
            what = "removed" if was.exists and not now.exists else "changed"
            problems.append(f"watched file {path} was {what} ({was} -> {now})")
    for name in sorted(after.containers - before.containers):
        if scope.owns_name(name):
            problems.append(f"a podman container of the provider remains: {name}")
    return problems


def assert_host_unaffected(before: HostSnapshot, after: HostSnapshot, *,
                           scope: Scope | None = None, ignore_build_cgroups: bool = False,
                           disk_slack_mb: int = 512) -> None:
    problems = differences(before, after, scope=scope, ignore_build_cgroups=ignore_build_cgroups,
                           disk_slack_mb=disk_slack_mb)
    assert not problems, "the host was affected:\n  " + "\n  ".join(problems)


def wait_host_unaffected(before: HostSnapshot, take: Callable[[], HostSnapshot], *,
                         timeout_s: float = 45, scope: Scope | None = None,
                         ignore_build_cgroups: bool = False,
                         disk_slack_mb: int = 512) -> HostSnapshot:
    """Snapshots until one shows no difference (the agent cleans up after reporting a job:
    its sandbox, image, cgroups), or fail with the differences of the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = take()
        problems = differences(before, after, scope=scope, disk_slack_mb=disk_slack_mb,
                               ignore_build_cgroups=ignore_build_cgroups)
        if not problems:
            return after
        if time.monotonic() > deadline:
            raise AssertionError(f"the host was still affected after {timeout_s:.0f} s:\n  "
                                 + "\n  ".join(problems))
        time.sleep(0.25)


def assert_not_leaked(secrets_: Iterable[str], **texts: str | bytes) -> None:
    """None of the secrets (canary tokens, the machine secret) appears in any of the texts."""
    for what, text in texts.items():
        data = text if isinstance(text, bytes) else text.encode("utf-8", "replace")
        for secret in secrets_:
            assert secret.encode() not in data, f"{secret[:24]}... leaked into {what}"


# --- host-side witnesses ----------------------------------------------------------------------

class CanaryListener:
    """A TCP listener (and a UDP socket on the same port) on the host that records everyone
    who reaches it: a job's own word that it could not connect is backed by the host's."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, port))
        self.tcp.listen(16)
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, self.port))
        self.hits: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="canary-listener")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.tcp, self.udp], [], [], 0.1)
            if not ready and self._stop.is_set():
                return  # stopped, and nothing left pending: every arrival is counted
            for sock in ready:
                if sock is self.tcp:
                    conn, peer = self.tcp.accept()
                    self.hits.append(f"tcp from {peer[0]}:{peer[1]}")
                    conn.close()
                else:
                    _, peer = self.udp.recvfrom(4096)
                    self.hits.append(f"udp from {peer[0]}:{peer[1]}")

    def settle(self) -> list[str]:
        """Stop listening once whatever already arrived is counted; the hits."""
        self._stop.set()
        self._thread.join(timeout=10)
        return self.hits

    def close(self) -> None:
        self.settle()
        self.tcp.close()
        self.udp.close()

    def __enter__(self) -> CanaryListener:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def host_address() -> str:
    """The host's own address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return str(s.getsockname()[0])


def descendants(pid: int, procs: Mapping[int, Proc] | None = None) -> set[int]:
    procs = procs if procs is not None else processes()
    found, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        for p in procs.values():
            if p.ppid == parent and p.pid not in found:
                found.add(p.pid)
                todo.append(p.pid)
    return found


def listening_ports_of(pids: Iterable[int]) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets these processes listen on, in the host's network
    namespace (a process in a namespace of its own shows none here)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = set()
    for proto in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:
                    addr, port = f[1].rsplit(":", 1)
                    found.add((_address(addr), int(port, 16)))
    return found
