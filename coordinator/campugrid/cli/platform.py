"""`campugrid up`: the whole platform on one machine, on embedded defaults.

SeaweedFS (S3), the OCI registry (unless CAMPUGRID_REGISTRY names one), a pull-through mirror
of Docker Hub (unless CAMPUGRID_REGISTRY_MIRRORS names one for it), the apt cache (unless
CAMPUGRID_APT_CACHE names one; the PyPI cache runs inside the coordinator) and the coordinator
run in this process's care; the agent runs as a separate
process, as the unprivileged provider user when started by root. Nothing outlives this process
(each child has a guard that kills it if we die, even by SIGKILL), and what an earlier, killed
run left is stopped at the next start. The same class brings the platform up for the
acceptance tests, so they exercise what the README runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from campugrid.cli.aptcache import EmbeddedAptCache
from campugrid.cli.registry import EmbeddedRegistry
from campugrid.cli.seaweed import EmbeddedS3, end_processes, free_port, guard_group
from campugrid.client import Api, Identity
from campugrid.coordinator import server
from campugrid.coordinator.bases import Source
from campugrid.coordinator.config import Settings
from campugrid.coordinator.registry import ensure_signing_key
from campugrid.guards import release_guard
from campugrid.protocol.errors import CampugridError, StorageError
from campugrid.protocol.identities import default_path as default_identity

log = logging.getLogger(__name__)
PROVIDER_USER_ENV, PROVIDER_USER = "CAMPUGRID_AGENT_USER", "campugrid"
BASE_IMAGE = "localhost/campugrid/python:bookworm"
RESTART_DELAYS_S = (1.0, 30.0)  # first, most: doubling in between
STABLE_AFTER_S = 60.0  # an agent up this long starts again from the first delay
HUB, HUB_ENV = "https://registry-1.docker.io", "CAMPUGRID_HUB_UPSTREAM"  # what the mirror caches
REGISTRY_GC_S = 3600.0  # how often the embedded registry drops blobs of deleted images


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/campugrid")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "campugrid"


def _answers(url: str, timeout_s: float = 3.0) -> None:
    """StorageError unless the registry at `url` answers within `timeout_s`, name lookup
    included (which no HTTP timeout covers): the mirror's registry would wait on it, then
    die."""
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            httpx.get(f"{url.rstrip('/')}/v2/", timeout=timeout_s)
            outcome.append(None)
        except httpx.HTTPError as e:
            outcome.append(e)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(timeout_s)
    if not outcome or outcome[0] is not None:
        raise StorageError(str(outcome[0]) if outcome else f"no answer in {timeout_s:.0f} s")


def _agent_pid(pid: int) -> int:
    """The agent's own process: `pid`, or its one child when `pid` is the runuser it was
    started through. SIGTERM goes to the agent alone: runuser would pass a second one on
    (which stops the agent's task at once instead of draining it) and then wait 2 s."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "runuser":
            return pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pid
    return int(children[0]) if len(children) == 1 else pid


@dataclasses.dataclass(frozen=True)
class ProviderUser:
    """Who the agent runs as: the dedicated user when we are root, else ourselves."""

    name: str
    uid: int
    gid: int
    home: Path

    @classmethod
    def resolve(cls) -> ProviderUser:
        if os.geteuid() != 0:
            pw = pwd.getpwuid(os.geteuid())
        else:
            name = os.environ.get(PROVIDER_USER_ENV, PROVIDER_USER)  # read now: tests set it
            try:
                pw = pwd.getpwnam(name)
            except KeyError as e:
                raise CampugridError(
                    f"no user {name!r} to run the agent as; run infra/setup.sh as root "
                    "(the agent never runs as root)") from e
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))

    @property
    def runtime_dir(self) -> Path:
        return Path(f"/run/user/{self.uid}")

    def env(self) -> dict[str, str]:
        """A clean environment, but for the locale and the agent's own settings by
        environment (the tests ask agents for work more often than every second)."""
        keep = {k: v for k, v in os.environ.items()
                if k in ("LANG", "LC_ALL", "TZ", "CAMPUGRID_LOG_FORMAT",
                         "CAMPUGRID_AGENT_POLL_SECONDS", "CAMPUGRID_BUILD_NETWORK",
                         "CAMPUGRID_BUILD_CA_FILE", "CAMPUGRID_EGRESS_HOSTS",
                         "CAMPUGRID_EGRESS_PINS", "CAMPUGRID_EGRESS_GATEWAYS",
                         "CAMPUGRID_ALLOWED_BASES")}
        return {**keep, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                "XDG_RUNTIME_DIR": str(self.runtime_dir), "PYTHONUNBUFFERED": "1"}

    def command(self, argv: list[str]) -> list[str]:
        """argv as this user (through runuser when we are root), with a clean environment."""
        env = [f"{k}={v}" for k, v in self.env().items()]
        if os.geteuid() == 0:
            return ["runuser", "-u", self.name, "--", "env", "-i", *env, *argv]
        return ["env", "-i", *env, *argv]

    def prepare(self, *dirs: Path) -> None:
        """Own the agent's folders; check the user can run our Python at all."""
        if os.geteuid() != 0:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
            return
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.runtime_dir, self.uid, self.gid)
        os.chmod(self.runtime_dir, 0o700)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, self.uid, self.gid)
            os.chmod(d, 0o700)
        probe = subprocess.run(self.command([sys.executable, "-c", "import campugrid.agent.worker"]),
                               capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode != 0:
            raise CampugridError(
                f"user {self.name} cannot run {sys.executable} with campugrid importable: "
                f"{probe.stderr.strip()[-300:]}\nPut the checkout and its .venv where that user "
                "can read them (not under /root).")

    def has_image(self, image: str) -> bool:
        return subprocess.run(self.command(["podman", "image", "exists", image]),
                              capture_output=True, timeout=120, check=False).returncode == 0


@dataclasses.dataclass
class AgentHandle:
    """A running agent process: the tests kill, drain and identify agents through this.
    With `restart`, the platform starts it again when it dies; `proc` is then the new one."""

    name: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    argv: list[str] = dataclasses.field(default_factory=list)
    log_file: Path | None = None
    restart: bool = False
    restarts: int = 0
    guard: subprocess.Popen[bytes] | None = None
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    restart_delay_s: float = dataclasses.field(default=RESTART_DELAYS_S[0], init=False)
    restart_at: float | None = dataclasses.field(default=None, init=False)

    def machine_id(self) -> str | None:
        return joined_machine(self.state_dir)

    def pid(self) -> int:
        """The agent's own Python process (under runuser when started by root)."""
        if os.geteuid() != 0:
            return self.proc.pid
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True, check=False).stdout.split()
        return int(children[0]) if children else self.proc.pid


@dataclasses.dataclass
class Platform:
    state_dir: Path
    http_port: int = 8750
    grpc_port: int = 0
    lease_seconds: float = 12.0
    # Where the local admin's identity is (made at the first start, or again when missing);
    # None: the CLI's default (~/.config/campugrid/identity.json), as `campugrid up` uses it.
    admin_identity: Path | None = None
    s3: EmbeddedS3 | None = None
    registry: EmbeddedRegistry | None = None
    mirror: EmbeddedRegistry | None = None
    apt_cache: EmbeddedAptCache | None = None
    hub_upstream: str = ""  # what the mirror caches (default: CAMPUGRID_HUB_UPSTREAM, else HUB)
    running: server.Running | None = None
    agents: list[AgentHandle] = dataclasses.field(default_factory=list)
    _http_thread: threading.Thread | None = None
    _http_socket: socket.socket | None = None  # the REST port, held from the start
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.grpc_port}"

    @property
    def pin(self) -> str:
        assert self.running is not None
        return self.running.certificate.fingerprint

    @property
    def identity_path(self) -> Path:
        return self.admin_identity or default_identity()

    def api(self) -> Api:
        """The REST API as the local admin."""
        return Api(self.url, Identity.load(self.identity_path))

    def cli_env(self) -> dict[str, str]:
        """The environment in which a `campugrid` command talks to this platform as its
        local admin."""
        return {**os.environ, "CAMPUGRID_SERVER": self.url,
                "CAMPUGRID_IDENTITY": str(self.identity_path)}

    def start(self) -> Platform:
        # The REST port is held from the first moment: no port taken below (S3, registries,
        # egress, gRPC: free_port) can turn out to be it.
        try:
            self._http_socket = socket.create_server(("127.0.0.1", self.http_port))
        except OSError as e:
            raise CampugridError(f"cannot listen on 127.0.0.1:{self.http_port} for the REST "
                                 f"API: {e.strerror}; choose another port") from e
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)  # noqa: S103 - the agent user must traverse it
        # The S3 secret lives only in memory and SeaweedFS's 0600 config, new at every start.
        access, secret = "campugrid", secrets.token_urlsafe(32)
        self.s3 = EmbeddedS3(self.state_dir / "s3", access, secret)  # stop() sees it if start fails
        self.s3.start()
        settings = Settings.from_env(
            self.state_dir / "coordinator", s3_endpoint=self.s3.endpoint, s3_access_key=access,
            s3_secret_key=secret, http_port=self.http_port,
            grpc_port=self.grpc_port or free_port(), lease_seconds=self.lease_seconds,
            admin_identity=self.identity_path)
        _, cert = ensure_signing_key(settings.registry_dir)
        if not settings.registry:  # the embedded one, trusting the coordinator's tokens
            self.registry = EmbeddedRegistry(self.state_dir / "registry", cert).start()
            settings = dataclasses.replace(settings, registry=self.registry.address)
        if "docker.io" in settings.base_registries and \
                "docker.io" not in dict(settings.registry_mirrors):
            # FROMs on Docker Hub through a pull-through cache here, first (beside mirrors of
            # other registries the operator names): a sweep over many machines fetches each
            # layer from the internet once.
            upstream = self.hub_upstream or os.environ.get(HUB_ENV, HUB)
            try:
                _answers(upstream)
                self.mirror = EmbeddedRegistry(self.state_dir / "mirror", cert,
                                               proxy=upstream).start()
                settings = dataclasses.replace(settings, registry_mirrors=(
                    *settings.registry_mirrors,
                    ("docker.io", Source(self.mirror.address, insecure=True, mirror=True))))
            except StorageError as e:  # the registry will not start without its upstream
                log.warning("no Docker Hub mirror: %s cannot be reached (%s); FROMs on Docker "
                            "Hub are resolved and pulled from it directly", upstream, e)
        # The machines' package caches (coordinator/mirrors.py): a build's wheels and Debian
        # packages come from the internet once for a sweep over many machines; and the
        # egress proxy that builds reach package registries through (campugrid.egress), on
        # a port of its own that leases name.
        settings = dataclasses.replace(settings, pip_mirror_dir=settings.pip_mirror_dir or
                                       str(self.state_dir / "pypi"),
                                       egress_port=settings.egress_port or free_port())
        if not settings.apt_cache:
            try:
                self.apt_cache = EmbeddedAptCache(self.state_dir / "apt-cache").start()
                settings = dataclasses.replace(settings, apt_cache=self.apt_cache.address)
            except StorageError as e:
                log.warning("no apt cache (%s): agents fetch Debian packages from the "
                            "distributions' mirrors directly", e)
        self.running = server.start(settings)
        if self.registry is not None:
            threading.Thread(target=self._collect_registry, daemon=True,
                             name="registry-gc").start()
        held = ([self._http_socket] if settings.http_host == "127.0.0.1" else None)
        if held is None:  # served elsewhere (CAMPUGRID_HTTP_HOST): uvicorn binds it itself
            self._http_socket.close()
        self._http_thread = threading.Thread(target=self.running.http.run, daemon=True,
                                             name="http", kwargs={"sockets": held})
        self._http_thread.start()
        deadline = time.monotonic() + 30
        while not self.running.http.started:
            if time.monotonic() > deadline or not self._http_thread.is_alive():
                raise CampugridError(f"the REST API did not start on port {self.http_port}")
            time.sleep(0.05)
        return self

    def _collect_registry(self) -> None:
        """The coordinator deletes images no job needs; their blobs go here, when there are
        some (the registry pauses for it, about a second: a pull then fails and that machine
        builds the image itself)."""
        seen = 0
        while not self._stopping.wait(REGISTRY_GC_S):
            assert self.running is not None and self.registry is not None
            deleted = self.running.coord.images.collected
            if deleted == seen:
                continue
            try:
                self.registry.garbage_collect()
                seen = deleted
            except CampugridError as e:
                log.warning("registry garbage collection: %s", e)

    def start_agent(self, name: str = "local-agent", log_file: Path | None = None,
                    user: ProviderUser | None = None, coordinator: str | None = None,
                    restart: bool = False, approve: bool = True,
                    pin: str | None = None, args: tuple[str, ...] = (),
                    program: tuple[str, ...] = ("-m", "campugrid.cli")) -> AgentHandle:
        """Join an agent (`campugrid agent join`, as the provider user) and start it; with
        `approve`, approve it as its owner (same host, same owner); with `restart`, start it
        again (with back-off) whenever it dies. `program`: what the Python interpreter runs
        for `agent run` (the CLI; the tests' dishonest agent wraps it)."""
        user = user or ProviderUser.resolve()
        agent_dir = self.state_dir / "agents" / name
        (self.state_dir / "agents").mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir / "agents", 0o711)  # noqa: S103 - likewise
        user.prepare(agent_dir)
        if not user.has_image(BASE_IMAGE):
            raise CampugridError(f"{BASE_IMAGE} is missing for user {user.name}; "
                                 "run infra/base-image.sh (infra/setup.sh does it)")
        stale = agents_using(agent_dir)
        if stale:  # left by a run of ours that was killed with its guard
            log.warning("stopping agent processes left running on %s (pid %s)", agent_dir,
                        ", ".join(map(str, stale)))
            end_processes(stale, f"an agent on {agent_dir}")
        joined = subprocess.run(user.command([
            sys.executable, "-m", "campugrid.cli", "agent", "join",
            coordinator or self.grpc_address, "--pin", pin or self.pin, "--state-dir", str(agent_dir),
            "--name", name]), capture_output=True, text=True, timeout=120, check=False)
        if joined.returncode != 0:
            raise CampugridError(f"agent {name} could not join: "
                                 f"{(joined.stderr or joined.stdout).strip()[-500:]}")
        machine_id = joined_machine(agent_dir)
        if machine_id is None:
            raise CampugridError(f"agent {name} joined but kept no machine id in {agent_dir}")
        if approve:
            assert self.running is not None
            m = self.running.coord.machines.approve(machine_id)
            log.info("approved the local agent %s as machine %s (fingerprint %s): same host, "
                     "same owner", name, m.id, m.fingerprint)
        argv = user.command([sys.executable, *program, "agent", "run",
                             "--state-dir", str(agent_dir), "--name", name, *args])
        log_file = log_file or agent_dir.with_suffix(".log")
        handle = AgentHandle(name, agent_dir, _spawn(argv, log_file), argv=argv,
                             log_file=log_file, restart=restart)
        # Our own child runs as root (runuser) or as us, so its group is ours to kill.
        handle.guard = guard_group(handle.proc.pid)
        with self._lock:
            self.agents.append(handle)
            if self._supervisor is None:
                self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                                    name="agent-supervisor")
                self._supervisor.start()
        return handle

    def _supervise(self) -> None:
        """Reap agents as they die (then their guards go), and restart those that asked."""
        while not self._stopping.wait(0.25):
            with self._lock:
                for agent in self.agents:
                    self._look_after(agent)

    def _look_after(self, agent: AgentHandle) -> None:
        if agent.proc.poll() is None:
            return
        guard, agent.guard = agent.guard, None  # (under the lock, as in _terminate)
        if guard is not None:  # reaped: its group is gone, nothing left to guard
            release_guard(guard)
        if not agent.restart:
            return
        now = time.monotonic()
        if agent.restart_at is None:
            if now - agent.started_at >= STABLE_AFTER_S:
                agent.restart_delay_s = RESTART_DELAYS_S[0]
            agent.restart_at = now + agent.restart_delay_s
            log.warning("agent %s exited (status %s); starting it again in %.0f s", agent.name,
                        agent.proc.returncode, agent.restart_delay_s)
            agent.restart_delay_s = min(agent.restart_delay_s * 2, RESTART_DELAYS_S[1])
            return
        if now < agent.restart_at:
            return
        assert agent.log_file is not None
        agent.restart_at = None
        try:
            agent.proc = _spawn(agent.argv, agent.log_file)
        except OSError as e:
            log.error("agent %s could not be started again: %s", agent.name, e)
            return
        agent.guard = guard_group(agent.proc.pid)
        agent.started_at = now
        agent.restarts += 1
        log.warning("agent %s started again (pid %d, restart %d)", agent.name, agent.proc.pid,
                    agent.restarts)

    def stop_agent(self, agent: AgentHandle) -> None:
        """Stop one agent (SIGTERM: it drains what it runs; SIGKILL after 40 s), for good."""
        agent.restart = False
        self._terminate([agent])
        with self._lock:
            self.agents.remove(agent)

    def stop(self) -> None:
        # The supervisor first, so that it does not start again what we stop on purpose.
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
        self._terminate(self.agents)
        if self.running is not None:
            self.running.stop()
            if self._http_thread is not None:
                self._http_thread.join(timeout=10)
        if self._http_socket is not None:
            self._http_socket.close()
        for service in (self.registry, self.mirror, self.apt_cache):
            if service is not None:
                service.stop()
        if self.s3 is not None:
            self.s3.stop()


    def _terminate(self, agents: list[AgentHandle]) -> None:
        for agent in agents:
            if agent.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(_agent_pid(agent.proc.pid), signal.SIGTERM)
        for agent in agents:
            try:
                agent.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.proc.pid, signal.SIGKILL)
                agent.proc.wait()
            # The supervisor may be reaping it too: whoever takes the guard releases it.
            with self._lock:
                guard, agent.guard = agent.guard, None
            if guard is not None:
                release_guard(guard)


def joined_machine(agent_dir: Path) -> str | None:
    """The machine id `campugrid agent join` kept in an agent's state folder, if any."""
    try:
        found = json.loads((agent_dir / "membership.json").read_text())["machine_id"]
    except (OSError, ValueError, KeyError):
        return None
    return str(found) or None


def _spawn(argv: list[str], log_file: Path) -> subprocess.Popen[bytes]:
    with open(log_file, "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def agents_using(agent_dir: Path) -> list[int]:
    """Processes running `campugrid agent run --state-dir agent_dir` (runuser's included)."""
    wanted = os.fsencode(agent_dir)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        at = [i for i, a in enumerate(argv[:-1]) if a == b"--state-dir" and argv[i + 1] == wanted]
        if at and b"agent" in argv and b"run" in argv:
            found.append(int(entry.name))
    return found


def find_example(name: str) -> Path:
    for root in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = root / "examples" / name
        if (candidate / "Dockerfile").is_file():
            return candidate
    raise CampugridError(f"examples/{name} not found; run from the campugrid checkout")


def have(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]
