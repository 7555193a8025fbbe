"""The provider's policy on limits: an agent that cannot enforce what its owner requires
does not start, and says which limit and why."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def agent(provider, *args: str, tmp: str, env: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(provider.command(["env", *env, sys.executable, "-m", "campugrid.cli",
                                            "agent", "run", "--coordinator", "127.0.0.1:1",
                                            "--state-dir", tmp, "--once", *args]),
                          capture_output=True, text=True, timeout=120, cwd="/")


def test_a_limit_the_machine_cannot_enforce_stops_the_agent(provider, shared_tmp):
    # Without output slots, /output is only checked, not bounded: not enforced.
    out = agent(provider, "--require-limits", "memory,output", tmp=str(shared_tmp / "a"),
                env=(f"CAMPUGRID_SLOTS_DIR={shared_tmp / 'no-slots'}",))
    assert out.returncode == 2, out.stderr
    assert "cannot enforce output" in out.stderr and "no output slots" in out.stderr


def test_an_unknown_limit_is_named(provider, shared_tmp):
    out = agent(provider, "--require-limits", "memroy", tmp=str(shared_tmp / "b"))
    assert out.returncode == 2 and "--require-limits memroy: no such limit" in out.stderr
    assert "memory" in out.stderr  # the known names are listed
