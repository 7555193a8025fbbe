"""The command line refuses with a reason, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

from campugrid.cli.seaweed import free_port
from campugrid.client import Identity
from campugrid.protocol import keys

CLI = [sys.executable, "-m", "campugrid.cli"]


def identity(tmp_path: Path) -> dict[str, str]:
    """An app identity of its own (for a coordinator that is not there)."""
    key_file = tmp_path / "app.key"
    keys.write_private(key_file, keys.Ed25519PrivateKey.generate())
    path = Identity("http://127.0.0.1:1", "app-id", "app", key_file).save(tmp_path / "app.json")
    return {**os.environ, "CAMPUGRID_IDENTITY": str(path)}


def test_an_unreachable_coordinator_is_an_error_not_a_traceback(tmp_path):
    out = subprocess.run([*CLI, "jobs", "--server", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60, env=identity(tmp_path))
    assert out.returncode == 2 and "cannot reach the coordinator" in out.stderr
    assert "Traceback" not in out.stderr


def test_without_an_identity_the_cli_says_how_to_get_one(tmp_path):
    env = {**os.environ, "CAMPUGRID_IDENTITY": str(tmp_path / "none.json")}
    out = subprocess.run([*CLI, "jobs"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no identity at" in out.stderr and "campugrid login" in out.stderr


def test_a_key_readable_by_others_is_refused(tmp_path):
    env = identity(tmp_path)
    (tmp_path / "app.key").chmod(0o644)
    out = subprocess.run([*CLI, "jobs"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "readable by others" in out.stderr


def test_a_bad_spec_file_is_refused_before_anything_is_sent(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    for name, content in (("list.json", json.dumps([1])), ("bin.json", b"\xff\xfe"),
                          ("typo.json", json.dumps({"comand": "x"}))):
        spec = tmp_path / name
        spec.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = subprocess.run([*CLI, "submit", str(tmp_path), "--spec", str(spec), "--server",
                              f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                             timeout=60, env=identity(tmp_path))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("error: ")
