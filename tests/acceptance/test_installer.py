"""Issue 12's provider installer in a fresh user account, from `pip install` of this
repository's wheel: the consented root step, one install command, the machine pending until
approved, a job run by the agent it configured, and an uninstall that leaves nothing behind
(files, unit, containers, images, cgroups)."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import tar_folder
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
REPO = Path(__file__).resolve().parents[2]
HELLO = REPO / "examples" / "hello"
CGROUP = Path("/sys/fs/cgroup")


class Account:
    """A new user on this machine, as a provider who just ran `useradd` would be."""

    def __init__(self) -> None:
        self.name = "cgp" + secrets.token_hex(3)
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", self.name], check=True)
        pw = pwd.getpwnam(self.name)
        self.uid, self.home = pw.pw_uid, Path(pw.pw_dir)
        self.runtime = Path(f"/run/user/{self.uid}")
        self.runtime.mkdir(mode=0o700, exist_ok=True)
        os.chown(self.runtime, self.uid, pw.pw_gid)

    def argv(self, *args: str) -> list[str]:
        env = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
               "XDG_RUNTIME_DIR": str(self.runtime), "PATH": "/usr/local/bin:/usr/bin:/bin",
               "PYTHONUNBUFFERED": "1"}
        return ["runuser", "-u", self.name, "--", "env", "-i",
                *(f"{k}={v}" for k, v in env.items()), *args]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                              check=False)

    def install_wheel(self, wheel: Path) -> Path:
        """`pip install 'campugrid[agent]'` into a virtual environment of the user's own."""
        venv = self.home / "venv"
        for argv in (["/usr/bin/python3", "-m", "venv", str(venv)],
                     [str(venv / "bin/pip"), "install", "--quiet", f"{wheel}[agent]"]):
            done = self.run(*argv, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
        return venv / "bin/campugrid"

    def remove(self) -> None:
        subprocess.run(["pkill", "-KILL", "-u", self.name], check=False)
        time.sleep(0.5)
        subprocess.run(["userdel", "--remove", self.name], capture_output=True, check=False)
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


def cli_json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def test_a_provider_installs_runs_a_job_and_uninstalls_leaving_nothing():
    root = Path(tempfile.mkdtemp(prefix="campugrid-install-"))
    os.chmod(root, 0o711)
    account = Account()
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    agent: subprocess.Popen[str] | None = None
    try:
        # What the provider has: the package from a wheel, not this checkout.
        wheels = root / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w",
                        str(wheels), str(REPO)], check=True, capture_output=True, timeout=300)
        [wheel] = wheels.glob("campugrid-*.whl")
        os.chmod(wheels, 0o755)
        campugrid = str(account.install_wheel(wheel))

        # The one root step, for this user (what `install --yes` runs through sudo).
        prepared = subprocess.run([campugrid, "provider", "prepare", "--user", account.name,
                                   "--yes", "--json"], capture_output=True, text=True, timeout=120)
        done = cli_json(prepared)
        subtree = f"campugrid-{account.name}"
        assert done["ran"] and f"/memory/{subtree}" in done["script"]
        assert "set -eu" in done["script"]  # printed for review, before it ran
        for c in ("memory", "cpu", "pids"):
            assert (CGROUP / c / subtree).stat().st_uid == account.uid
        again = cli_json(subprocess.run([campugrid, "provider", "prepare", "--user",
                                         account.name, "--yes", "--json"], capture_output=True,
                                        text=True, timeout=120))
        assert again == {"ran": False, "script": ""}  # twice is harmless

        # What the storage check's fix says, then the jobs' base image (no registry here).
        conf = account.home / ".config/containers/storage.conf"
        conf.parent.mkdir(parents=True)
        conf.write_text('[storage]\ndriver = "overlay"\n')
        subprocess.run(["chown", "-R", f"{account.name}:", str(account.home / ".config")], check=True)
        subprocess.run([str(REPO / "infra/base-image.sh"), account.name], check=True,
                       capture_output=True, timeout=300)

        # One command, as the user: checks, configuration, key, registration, unit.
        share = account.home / "pictures"
        lent = str(account.home / "lent")  # not the default folder: uninstall must find it
        installed = account.run(campugrid, "provider", "install",
                                "--join", p.grpc_address, "--pin", p.pin, "--name", "inst-pc",
                                "--protect", "steam", "--keep-free-mb", "512",
                                "--share", f"pics={share}", "--state-dir", lent, "--json")
        assert installed.returncode == 2 and "is not a folder" in installed.stderr  # no share yet
        account.run("mkdir", str(share))
        info = cli_json(account.run(campugrid, "provider", "install",
                                    "--join", p.grpc_address, "--pin", p.pin, "--name",
                                    "inst-pc", "--protect", "steam", "--keep-free-mb", "512",
                                    "--share", f"pics={share}", "--state-dir", lent, "--json"))
        assert info["status"] == "pending" and not info["started"]  # no systemd on this machine
        assert info["state_dir"] == lent
        again = cli_json(account.run(campugrid, "provider", "install",
                                     "--join", p.grpc_address, "--pin", p.pin, "--name",
                                     "inst-pc", "--protect", "steam", "--keep-free-mb", "512",
                                     "--share", f"pics={share}", "--state-dir", lent, "--json"))
        assert again["machine_id"] == info["machine_id"]  # the same key: the same machine
        config, unit = Path(info["config"]), Path(info["unit"])
        assert 'protect = ["steam"]' in config.read_text() and "keep_free_mb = 512" in config.read_text()
        [exec_start] = [line for line in unit.read_text().splitlines()
                        if line.startswith("ExecStart=")]
        assert exec_start.startswith(f"ExecStart={Path(campugrid).parent}/python")  # the venv's
        assert exec_start.endswith(f" -m campugrid.cli agent run --config {config}")
        with p.api() as api:
            [m] = [m for m in api.machines() if m["id"] == info["machine_id"]]
            assert m["status"] == "pending" and m["fingerprint"] == info["fingerprint"]
            api.approve_machine(info["machine_id"])

            # The agent, in the foreground as install said (there is no systemd here).
            agent = subprocess.Popen(account.argv(campugrid, "agent", "run", "--config",
                                                  str(config)),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            job = api.submit(tar_folder(HELLO), JobSpec())
            done = api.wait(job["id"], timeout_s=240, poll_s=0.2)
            assert done["state"] == "succeeded" and done["machine_id"] == info["machine_id"], done
        # No --state-dir: status reads the folder install configured.
        status = cli_json(account.run(campugrid, "provider", "status", "--json"))
        assert status["agent"]["machine_id"] == info["machine_id"]
        assert status["agent"]["limits"]["memory"] == "enforced"  # the delegated cgroups
        assert status["agent"]["programs"] == ["steam"]

        # Uninstall: the running agent stops, and nothing it made remains.
        gone = cli_json(account.run(campugrid, "provider", "uninstall", "--json"))  # its config
        #                                                         names the state folder
        assert "the running agent" in gone["removed"]
        assert gone["machine_id"] == info["machine_id"]  # what the operator is told to revoke
        assert agent.wait(timeout=60) is not None
        for path in (config, unit, Path(info["state_dir"])):
            assert not path.exists(), path
        containers = account.run("podman", "ps", "-a", "--format", "{{.Names}}").stdout.split()
        assert containers == []
        images = account.run("podman", "images", "--format", "{{.Repository}}").stdout.split()
        assert [i for i in images if "campugrid-job" in i] == []
        for c in ("memory", "cpu", "pids"):
            assert [d.name for d in (CGROUP / c / subtree).iterdir() if d.is_dir()] == []
        twice = cli_json(account.run(campugrid, "provider", "uninstall", "--json"))
        assert twice["removed"] == []
        undone = cli_json(subprocess.run([campugrid, "provider", "prepare", "--user",
                                          account.name, "--undo", "--yes", "--json"],
                                         capture_output=True, text=True, timeout=120))
        assert undone["ran"]
        assert not any((CGROUP / c / subtree).exists() for c in ("memory", "cpu", "pids"))
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        if agent is not None and agent.stdout is not None:
            print("--- agent ---\n" + "".join(agent.stdout.readlines()[-30:]))
            agent.stdout.close()
        p.stop()
        account.remove()
        for c in ("memory", "cpu", "pids"):
            with_children = CGROUP / c / f"campugrid-{account.name}"
            if with_children.exists():
                subprocess.run(["find", str(with_children), "-depth", "-type", "d", "-delete"],
                               check=False)
        shutil.rmtree(root, ignore_errors=True)
