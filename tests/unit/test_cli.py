"""The command line refuses with a reason, never a traceback."""

import json
import subprocess
import sys

from campugrid.cli.seaweed import free_port

CLI = [sys.executable, "-m", "campugrid.cli"]


def test_an_unreachable_coordinator_is_an_error_not_a_traceback():
    out = subprocess.run([*CLI, "jobs", "--server", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach the coordinator" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_spec_file_is_refused_before_anything_is_sent(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    for name, content in (("list.json", json.dumps([1])), ("bin.json", b"\xff\xfe"),
                          ("typo.json", json.dumps({"comand": "x"}))):
        spec = tmp_path / name
        spec.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = subprocess.run([*CLI, "submit", str(tmp_path), "--spec", str(spec), "--server",
                              f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("error: ")
