"""GPU discovery where it runs something: runsc's flags, a GPU job under nvproxy (GPU machines
only), the speed score measured in a child (tests/unit/test_gpus.py has the rest)."""

from __future__ import annotations

import subprocess
import types

from campugrid.agent.prereqs import RUNSC_FAST, runsc_date
from campugrid.sandbox.podman_runsc import PodmanRunsc, nvproxy_support
from campugrid.sandbox.runtime import RunRequest


def test_nvproxy_is_detected_from_runsc_flags():
    def fake(flags_text):
        return lambda *a, **k: types.SimpleNamespace(stdout=flags_text, stderr="")
    assert nvproxy_support("runsc", fake("  -nvproxy\n    enable NVIDIA GPU support")) == ""
    assert "no nvproxy" in nvproxy_support("runsc", fake("  -network string\n"))
    # This machine's runsc: bookworm-backports' (20240729) has nvproxy, Debian 12's own
    # (20221219, where infra/setup.sh finds no backports) has none.
    version = subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout
    dated = runsc_date(version)
    assert dated is not None, version
    if dated >= RUNSC_FAST:
        assert nvproxy_support() == ""
    elif dated <= "20221219":
        assert "no nvproxy" in nvproxy_support()


def test_a_gpu_job_runs_under_runsc_with_nvproxy(tmp_path):
    req = RunRequest(name="j", image="img", command=None, env=(), output_dir=tmp_path,
                     data_dir=None, memory_mb=256, cpus=1, tmp_mb=16, wall_time_s=10,
                     gpus=(("GPU-aaa", 0),))
    argv = PodmanRunsc().argv(req)
    assert "nvproxy=true" in argv and "/dev/nvidia0" in argv
    assert argv[argv.index("--network") + 1] == "none"
    plain = PodmanRunsc().argv(RunRequest(**{**req.__dict__, "gpus": ()}))
    assert "nvproxy=true" not in plain and not any("nvidia" in a for a in plain)


def test_the_agent_measures_its_speed_in_a_child_and_keeps_nothing_of_it():
    import sys

    from campugrid.agent import speed

    before = set(sys.modules)
    assert speed.in_child(gpu=True) > 0  # no CUDA here: the CPU's score, from the child
    assert not {"numpy", "torch"} & (set(sys.modules) - before)  # imported there, not here
