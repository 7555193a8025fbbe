"""`--spec FILE` through the real command: a bad YAML spec is refused before anything is sent
(tests/unit/test_cli_spec.py has the cases that start no process)."""

import os
import subprocess
import sys
from pathlib import Path

from campugrid.cli.seaweed import free_port


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_the_cli_refuses_a_bad_yaml_spec_before_anything_is_sent(tmp_path):
    """No identity and no coordinator: the refusal comes first, with where and why."""
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    spec = write(tmp_path, "job.yaml", "name: a\nname: b\n")
    env = {**os.environ, "CAMPUGRID_IDENTITY": str(tmp_path / "none.json")}
    out = subprocess.run([sys.executable, "-m", "campugrid.cli", "submit", str(tmp_path), "--spec",
                          str(spec), "--json", "--server", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith(f"error: {spec}:2:1: the key 'name' is given twice"), out.stderr
    # and what JobSpec refuses in a YAML spec, it refuses as for JSON
    typo = write(tmp_path, "typo.yaml", "comand: x\n")
    out = subprocess.run([sys.executable, "-m", "campugrid.cli", "submit", str(tmp_path), "--spec",
                          str(typo)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "comand" in out.stderr and "no identity" not in out.stderr
