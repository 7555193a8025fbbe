"""Issue 11's "done when", through the README's commands: a new laptop joins with an invite
and submits; a second agent joins with the one printed command, waits as pending, runs jobs
once approved, and stops getting work once revoked."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
CLI = [sys.executable, "-m", "campugrid.cli"]


def run(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def wait_until(what: str, check, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def test_a_laptop_joins_by_invite_and_a_machine_by_approval_until_revoked():
    root = Path(tempfile.mkdtemp(prefix="campugrid-trust-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        admin = p.cli_env()
        # A new laptop: an invite from the admin, a key of its own, a job of its own.
        invite = run(admin, "apps", "invite", "laptop").splitlines()[-1].split()
        assert invite[:3] == ["campugrid", "login", p.url]
        laptop = {**os.environ, "CAMPUGRID_IDENTITY": str(root / "laptop" / "identity.json")}
        assert "as app 'laptop'" in run(laptop, *invite[1:])
        assert "laptop" in run(admin, "apps")
        job = run(laptop, "submit", str(HELLO)).strip()
        # A second machine: the one command the admin is given, then pending.
        join = run(admin, "machines", "invite").split()
        assert join[:3] == ["campugrid", "agent", "join"] and join[4] == "--pin"
        shared = root / "pictures"  # a folder its owner shares: readable by the agent's user
        (shared / "train").mkdir(parents=True)
        (shared / "train" / "a.csv").write_bytes(b"4,2\n")
        for d in (shared, shared / "train"):
            d.chmod(0o755)
        (shared / "train" / "a.csv").chmod(0o644)
        agent = p.start_agent("joiner", coordinator=join[3], pin=join[5], approve=False,
                              args=("--share", f"pics={shared}"))
        machine = wait_until("the machine's id", agent.machine_id)
        listed = run(admin, "machines")
        assert f"{machine}  pending" in listed
        # It has asked for work (and logged the refusal): it must get nothing while pending.
        wait_until("the pending agent to ask for work", lambda: "waiting for approval" in (
            agent.log_file.read_text() if agent.log_file else ""))
        status = run(laptop, "status", job)
        assert "state    queued" in status and "wait for their owner's approval" in status
        # Approved: it takes the laptop's job and runs it.
        assert f"approved {machine}" in run(admin, "machines", "approve", machine)
        wait_until("the job to succeed", lambda: "state    succeeded" in run(laptop, "status", job),
                   timeout=240)
        with p.api() as api:
            assert api.job(job)["machine_id"] == machine
        # Its shared folder: listed by path inside it and sha256, read by a job in place.
        with Api.from_identity(root / "laptop" / "identity.json") as lab:
            digest = hashlib.sha256(b"4,2\n").hexdigest()
            listed = wait_until("the share's listing", lambda: [
                f for sh in lab.shares() if sh["name"] == "pics" for f in sh["files"]])
            assert listed == [{"path": "train/a.csv", "size": 4, "sha256": digest, "machines": 1}]
            assert str(shared) not in str(lab.shares())
            reads = lab.submit(tar_folder(HELLO), JobSpec.from_dict({
                "command": ["cat", "/data/d/train/a.csv"],
                "datasets": [{"name": "d", "share": "pics", "sha256": {"train/a.csv": digest}}]}))
            done = lab.wait(reads["id"], timeout_s=240, poll_s=0.2)
            assert done["state"] == "succeeded" and done["result"] == "4,2", done
            log = "".join(c["text"] for c in lab.logs(reads["id"])["chunks"])
            assert "dataset d: 1 file" in log
            assert "from the share 'pics', 4 bytes, each checked by sha256" in log
        # The laptop cannot see the admin's jobs, nor manage machines.
        denied = subprocess.run([*CLI, "machines"], capture_output=True, text=True, timeout=60,
                                env=laptop)
        assert denied.returncode == 2 and "not an admin" in denied.stderr
        # Revoked: the agent stops, and new work waits for an approved machine.
        assert f"revoked {machine}" in run(admin, "machines", "revoke", machine)
        assert agent.proc.wait(timeout=60) != 0
        log = agent.log_file.read_text() if agent.log_file else ""
        assert "revoked by its owner" in log
        second = run(laptop, "submit", str(HELLO)).strip()
        # No wait: its only machine is revoked and its agent gone (above), none could take it.
        status = run(laptop, "status", second)
        assert "state    queued" in status and "no approved machine online" in status
    finally:
        p.stop()
        shutil.rmtree(root, ignore_errors=True)
