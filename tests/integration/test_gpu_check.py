"""bench/gpu_check.py, in every part that needs no GPU: what it carries, how it reads
nvidia-smi against the agent's own discovery, the OCI bundle it runs under the real runsc
(here without GPUs), its verdicts, and its answer on a machine with none. The GPU itself is
checked when a session is lent a GPU machine (the script's own run is that contract)."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from campugrid.agent.gpus import GpuPolicy, discover
from tests.support.runtimes import gvisor_kernel
from tests.unit.test_gpus import FakeNvml

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402

RUNSC = shutil.which("runsc")
SMI = ("GPU-aaa, NVIDIA GeForce RTX 4090, 24564, 23000, 8.9, 550.54.15\n"
       "GPU-bbb, NVIDIA A100-SXM4-80GB, 81920, 51200, 8.0, 550.54.15\n")


def smi_rows(text: str = SMI) -> list[dict[str, str]]:
    return gpu_check.smi_gpus(lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=text))


def test_nvidia_smi_is_read_field_by_field_and_its_absence_is_no_gpu():
    rows = smi_rows()
    assert rows[1] == {"uuid": "GPU-bbb", "name": "NVIDIA A100-SXM4-80GB", "memory.total": "81920",
                       "memory.free": "51200", "compute_cap": "8.0",
                       "driver_version": "550.54.15"}
    failed = gpu_check.smi_gpus(lambda *a, **k: types.SimpleNamespace(returncode=9, stdout=""))
    assert failed == []

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    assert gpu_check.smi_gpus(missing) == []


def test_the_agents_discovery_is_held_to_nvidia_smi():
    found = discover(GpuPolicy(), FakeNvml()).gpus
    assert gpu_check.compare(found, smi_rows()) == []
    # One GPU the agent missed, another whose driver and free memory disagree.
    other = SMI.replace("GPU-aaa", "GPU-zzz").replace("51200", "30000").replace(
        "8.0, 550.54.15", "8.0, 580.159.03")
    problems = gpu_check.compare(found, smi_rows(other))
    assert any("GPU-zzz" in p and "GPU-aaa" in p for p in problems)
    assert any(p.startswith("GPU-bbb driver") for p in problems)
    assert any(p.startswith("GPU-bbb free MB") for p in problems)
    # The owner's reserve is the agent's to keep: a reserve smaller than 2 % passes.
    assert gpu_check.compare(discover(GpuPolicy(reserve_mb=400), FakeNvml()).gpus, smi_rows()) == []


def test_the_bundle_maps_only_the_reserved_gpu_with_the_agents_devices(tmp_path):
    def stat_of(node: str) -> os.stat_result:
        minor = int(node.removeprefix("/dev/nvidia"))
        return types.SimpleNamespace(st_rdev=os.makedev(195, minor), st_mode=0o20666)  # type: ignore[return-value]

    folder = gpu_check.bundle(tmp_path / "b", ["python3", "probe.py"], (("GPU-bbb", 3),),
                              {"PYTHONPATH": "/x"}, stat_of=stat_of)
    config = json.loads((folder / "config.json").read_text())
    nodes = [d for d in config["linux"]["devices"] if d["path"].startswith("/dev/nvidia")
             and d["path"][len("/dev/nvidia"):].isdigit()]
    assert nodes == [{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3,
                      "fileMode": 0o666, "uid": 0, "gid": 0}]
    env = dict(v.split("=", 1) for v in config["process"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "GPU-bbb"
    assert env["PYTHONPATH"] == "/x"
    assert config["root"] == {"path": "/", "readonly": True}
    assert {"type": "network"} in config["linux"]["namespaces"]


@pytest.mark.skipif(os.geteuid() != 0 or RUNSC is None, reason="runs runsc as root")
def test_the_bundle_runs_under_gvisor_read_only_and_without_network(tmp_path):
    os.chmod(tmp_path, 0o755)
    code = ("import json, os, socket\n"
            "try:\n    open('/usr/gpu-check', 'w'); wrote = True\n"
            "except OSError:\n    wrote = False\n"
            "s = socket.socket(); s.settimeout(2)\n"
            "print(json.dumps({'kernel': os.uname().release, 'wrote': wrote,"
            " 'net': s.connect_ex(('1.1.1.1', 443))}))\n")
    folder = gpu_check.bundle(tmp_path / "b", [sys.executable, "-c", code], (), {})
    said = gpu_check.sandboxed(Path(RUNSC), folder, nvproxy=False, timeout=60)
    assert gvisor_kernel(said["kernel"])
    assert said["wrote"] is False  # the host's root, read-only
    assert said["net"] != 0


def test_what_travels_is_the_runsc_compressed_and_nvml_within_the_limit(tmp_path, monkeypatch):
    fake = tmp_path / "runsc"
    fake.write_bytes(b"\x7fELF" + os.urandom(1000) * 50)
    written = gpu_check.prepare(fake, tmp_path / "carry")
    assert {p.name for p in written} == {"runsc.xz", "pynvml.py"}
    unpacked = gpu_check.unpack_runsc(tmp_path / "carry", tmp_path)
    assert unpacked.read_bytes() == fake.read_bytes() and os.access(unpacked, os.X_OK)
    assert lzma.decompress((tmp_path / "carry" / "runsc.xz").read_bytes()) == fake.read_bytes()
    monkeypatch.setattr(gpu_check, "CARRY_LIMIT", 1000)
    with pytest.raises(SystemExit, match="over"):
        gpu_check.prepare(fake, tmp_path / "carry")


def test_verdicts_follow_the_figures(tmp_path, monkeypatch):
    """The checks' logic over a GPU's figures (the GPU's own run is the contract)."""
    nvml = FakeNvml()
    nvml.devices = nvml.devices[1:]
    monkeypatch.setattr(gpu_check, "discover", lambda policy: discover(policy, nvml))
    rows = smi_rows(SMI.splitlines()[1])
    monkeypatch.setattr(gpu_check, "smi_gpus", lambda: rows)
    monkeypatch.setattr(gpu_check, "native", lambda alloc_mb: {"cuda": True, "tflops": 100.0})
    monkeypatch.setattr(gpu_check, "bundle", lambda *a, **k: tmp_path)
    inside = {"cuda": True, "tflops": 96.0, "seen": ["GPU-bbb"], "allocated": True}
    monkeypatch.setattr(gpu_check, "sandboxed", lambda *a, **k: inside)
    report = gpu_check.check(Path("runsc"), tmp_path)
    assert report["gpu"] and all(c["ok"] for c in report["checks"].values()), report
    assert report["checks"]["reservation"]["granted_mb"] == 51000
    inside.update(tflops=90.0, seen=["GPU-bbb", "GPU-aaa"], allocated=False)
    checks = gpu_check.check(Path("runsc"), tmp_path)["checks"]
    assert not checks["speed"]["ok"] and checks["speed"]["ratio"] == 0.9
    assert not checks["isolation"]["ok"] and not checks["reservation"]["ok"]
    assert checks["discovery"]["ok"]


@pytest.mark.skipif(gpu_check.smi_gpus() != [], reason="this machine has an NVIDIA GPU")
def test_on_a_machine_without_a_gpu_it_says_so_and_checks_nothing(tmp_path):
    done = subprocess.run(["/usr/bin/python3", str(BENCH / "gpu_check.py"), "--runsc",
                           RUNSC or "runsc", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["gpu"] is False and report["checks"] == {}
    assert "no NVIDIA GPU" in report["why"] and "nothing checked" in done.stderr
    assert gpu_check.probe(0)["cuda"] is False
