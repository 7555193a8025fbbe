"""The agent as a provider installs it: its configuration file (what the owner lends), a
systemd user unit that runs it, and everything uninstall removes again.

Nothing here needs root: the few root-only fixes are `prereqs.root_step`, which the owner
reads and consents to separately.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from campugrid.agent import status
from campugrid.protocol.errors import InvalidInput
from campugrid.sandbox.slots import remove_tree

UNIT_NAME = "campugrid-agent.service"
AGENT_DIR = Path("~/.local/share/campugrid-agent").expanduser()  # its key, membership, work
FIELDS = ("name", "state_dir", "shares", "gpus", "keep_free_mb", "protect", "hours")


def config_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def default_config() -> Path:
    return config_dir() / "campugrid" / "agent.toml"


def unit_path() -> Path:
    return config_dir() / "systemd" / "user" / UNIT_NAME


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What the owner lends, as `agent run` options; the file is the owner's to edit."""

    state_dir: Path
    name: str = dataclasses.field(default_factory=socket.gethostname)
    shares: Mapping[str, str] = dataclasses.field(default_factory=dict)  # NAME -> folder
    gpus: tuple[str, ...] | None = None  # indexes or UUIDs; None: all
    keep_free_mb: int = 0  # GPU memory always left free, per GPU
    protect: tuple[str, ...] = ()  # programs that take the machine back while they run
    hours: str = ""  # when new work is taken, HH:MM-HH:MM[,...]; "": any time

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise InvalidInput(f"{path}: cannot read the agent's configuration ({e.strerror})") from e
        except tomllib.TOMLDecodeError as e:
            raise InvalidInput(f"{path}: not valid TOML ({e})") from e
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> AgentConfig:
        for key in data:
            if key not in FIELDS:
                close = difflib.get_close_matches(key, FIELDS, n=1)
                raise InvalidInput(f"{where}: unknown setting {key!r}"
                                   + (f" (did you mean {close[0]!r}?)" if close else
                                      f"; known: {', '.join(FIELDS)}"))

        def text(key: str, default: str) -> str:
            value = data.get(key, default)
            if not isinstance(value, str):
                raise InvalidInput(f"{where}: {key} must be text in quotes")
            return value

        def names(key: str) -> tuple[str, ...]:
            value = data.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str | int) for v in value):
                raise InvalidInput(f"{where}: {key} must be a list, like [\"steam\", \"blender\"]")
            return tuple(str(v) for v in value)

        shares = data.get("shares", {})
        if not isinstance(shares, dict) or not all(isinstance(v, str) for v in shares.values()):
            raise InvalidInput(f"{where}: shares must be a table of NAME = \"/folder\"")
        keep = data.get("keep_free_mb", 0)
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise InvalidInput(f"{where}: keep_free_mb must be a whole number of MB, 0 or more")
        gpus = data.get("gpus", "all")
        return cls(state_dir=Path(text("state_dir", "")).expanduser() if data.get("state_dir")
                   else Path(), name=text("name", socket.gethostname()), shares=dict(shares),
                   gpus=None if gpus == "all" else names("gpus"), keep_free_mb=keep,
                   protect=names("protect"), hours=text("hours", ""))

    def dumps(self) -> str:
        """The file as the installer writes it: every setting, with what it means."""
        q = json.dumps  # a JSON string is a TOML basic string
        shares = "".join(f"{q(k)} = {q(v)}\n" for k, v in sorted(self.shares.items()))
        return (
            "# campugrid provider agent: what this machine lends. Edit it, then restart the\n"
            "# agent (systemctl --user restart campugrid-agent). `campugrid provider pause`\n"
            "# takes the machine back at any time.\n\n"
            f"name = {q(self.name)}  # how the coordinator's operator sees this machine\n"
            f"state_dir = {q(str(self.state_dir))}  # its key, membership and work folders\n"
            "# GPUs to lend: \"all\", or a list of indexes or UUIDs\n"
            f"gpus = {q('all') if self.gpus is None else json.dumps(list(self.gpus))}\n"
            f"keep_free_mb = {self.keep_free_mb}  # GPU memory always left for you, per GPU\n"
            "# Programs that take the machine back while they run (games, renderers)\n"
            f"protect = {json.dumps(list(self.protect))}\n"
            "# When new work is taken, local time (e.g. \"22:00-07:00\"); \"\" = any time\n"
            f"hours = {q(self.hours)}\n\n"
            "# Folders jobs may read (read-only, by path inside them and sha256), by name\n"
            f"[shares]\n{shares}")

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.dumps())
        tmp.chmod(0o600)
        tmp.replace(path)


def scope_of(state_dir: Path) -> str:
    """The name under which the agent of `state_dir` makes cgroups, images and containers:
    what its sweeps, and uninstall, may remove."""
    return "a-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]


def unit_text(config: Path, python: str = sys.executable) -> str:
    """The systemd user unit: the agent as this user, restarted if it fails, never as root."""
    return (
        "[Unit]\n"
        "Description=campugrid provider agent (lends this machine's idle time; "
        "campugrid provider pause takes it back)\n"
        "Wants=network-online.target\nAfter=network-online.target\n\n"
        "[Service]\n"
        f"ExecStart={_quoted(python)} -m campugrid.cli agent run --config {_quoted(str(config))}\n"
        "Restart=on-failure\nRestartSec=10\n"
        "# Exit status 3: the coordinator revoked this machine; restarting would not help.\n"
        "RestartPreventExitStatus=3\n"
        "NoNewPrivileges=yes\n\n"
        "[Install]\nWantedBy=default.target\n")


def _quoted(word: str) -> str:
    """One word of a unit's command line: quoted, with systemd's % specifiers escaped."""
    word = word.replace("%", "%%")
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"' if any(
        c in word for c in ' \t"\'\\') else word


def has_user_systemd() -> bool:
    """A systemd user manager to talk to (not on containers or machines without systemd)."""
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    out = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True,
                         text=True, timeout=30, check=False)
    return out.stdout.strip() in ("running", "degraded", "starting")


def systemctl(*args: str) -> tuple[int, str]:
    out = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True,
                         timeout=60, check=False)
    return out.returncode, (out.stdout + out.stderr).strip()


def stop_agent(state_dir: Path, wait_s: float = 30.0) -> bool:
    """Stop the agent that runs from `state_dir`, if one does (by the pid its status file
    names, checked against the process's start time). True if one was stopped."""
    state = status.read(state_dir)
    if state is None or not state.get("running"):
        return False
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = status.read(state_dir)
        if now is None or not now.get("running"):
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return True


def remove_state(state_dir: Path) -> None:
    if state_dir.exists() or state_dir.is_symlink():
        remove_tree(state_dir)
