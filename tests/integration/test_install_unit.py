"""The agent's systemd unit through systemd's own verifier (tests/unit/test_install.py has the
rest of the installer's parts)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from campugrid.agent.install import unit_text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_the_unit_passes_systemds_own_verifier(tmp_path):
    unit = tmp_path / "campugrid-agent.service"
    unit.write_text(unit_text(tmp_path / "agent.toml", sys.executable))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(unit_text(tmp_path / "agent.toml", "/nonexistent/python"))
    bad = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode != 0  # the verifier really checks the ExecStart
