"""The code stays lint-clean and type-checked (mypy strict on our packages)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff_is_clean():
    out = subprocess.run([BIN / "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_mypy_strict_is_clean():
    out = subprocess.run([BIN / "mypy", "coordinator/campugrid", "provider-agent/campugrid",
                          "sandbox/campugrid", "builders/campugrid", "checkpoint-hooks/campugrid"],
                         cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]
