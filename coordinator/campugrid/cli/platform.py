"""`campugrid up`: the whole platform on one machine, on embedded defaults.

SeaweedFS (S3) and the coordinator run in this process's care; the agent runs as a separate
process, as the unprivileged provider user when started by root. The same class brings the
platform up for the acceptance tests, so they exercise what the README runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from campugrid.coordinator import server
from campugrid.coordinator.config import Settings
from campugrid.coordinator.seaweed import EmbeddedS3, free_port
from campugrid.protocol.errors import CampugridError

PROVIDER_USER = os.environ.get("CAMPUGRID_AGENT_USER", "campugrid")
BASE_IMAGE = "localhost/campugrid/python:bookworm"


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/campugrid")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "campugrid"


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
            try:
                pw = pwd.getpwnam(PROVIDER_USER)
            except KeyError as e:
                raise CampugridError(
                    f"no user {PROVIDER_USER!r} to run the agent as; run infra/setup.sh as root "
                    "(the agent never runs as root)") from e
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))

    @property
    def runtime_dir(self) -> Path:
        return Path(f"/run/user/{self.uid}")

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ")}
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
    """A running agent process: the tests kill, drain and identify agents through this."""

    name: str
    state_dir: Path
    proc: subprocess.Popen[bytes]

    def machine_id(self) -> str | None:
        try:
            return str(json.loads((self.state_dir / "credentials.json").read_text())["machine_id"])
        except (OSError, ValueError, KeyError):
            return None

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
    s3: EmbeddedS3 | None = None
    running: server.Running | None = None
    agents: list[AgentHandle] = dataclasses.field(default_factory=list)
    _http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.grpc_port}"

    def start(self) -> Platform:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)  # noqa: S103 - the agent user must traverse it
        # The S3 secret lives only in memory and SeaweedFS's 0600 config, new at every start.
        access, secret = "campugrid", secrets.token_urlsafe(32)
        self.s3 = EmbeddedS3(self.state_dir / "s3", access, secret).start()
        settings = Settings.from_env(
            self.state_dir / "coordinator", s3_endpoint=self.s3.endpoint, s3_access_key=access,
            s3_secret_key=secret, http_port=self.http_port,
            grpc_port=self.grpc_port or free_port(), lease_seconds=self.lease_seconds)
        self.running = server.start(settings)
        self._http_thread = threading.Thread(target=self.running.http.run, daemon=True,
                                             name="http")
        self._http_thread.start()
        deadline = time.monotonic() + 30
        while not self.running.http.started:
            if time.monotonic() > deadline or not self._http_thread.is_alive():
                raise CampugridError(f"the REST API did not start on port {self.http_port}")
            time.sleep(0.05)
        return self

    def start_agent(self, name: str = "local-agent", log_file: Path | None = None,
                    user: ProviderUser | None = None, coordinator: str | None = None) -> AgentHandle:
        user = user or ProviderUser.resolve()
        agent_dir = self.state_dir / "agents" / name
        (self.state_dir / "agents").mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir / "agents", 0o711)  # noqa: S103 - likewise
        user.prepare(agent_dir)
        if not user.has_image(BASE_IMAGE):
            raise CampugridError(f"{BASE_IMAGE} is missing for user {user.name}; "
                                 "run infra/base-image.sh (infra/setup.sh does it)")
        argv = user.command([sys.executable, "-m", "campugrid.cli", "agent", "run",
                             "--coordinator", coordinator or self.grpc_address,
                             "--state-dir", str(agent_dir),
                             "--name", name])
        with open(log_file or agent_dir.with_suffix(".log"), "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        handle = AgentHandle(name, agent_dir, proc)
        self.agents.append(handle)
        return handle

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                os.killpg(agent.proc.pid, signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(agent.proc.pid, signal.SIGKILL)
                agent.proc.wait()
        if self.running is not None:
            self.running.stop()
            if self._http_thread is not None:
                self._http_thread.join(timeout=10)
        if self.s3 is not None:
            self.s3.stop()


def find_example(name: str) -> Path:
    for root in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = root / "examples" / name
        if (candidate / "Dockerfile").is_file():
            return candidate
    raise CampugridError(f"examples/{name} not found; run from the campugrid checkout")


def have(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]
