"""GPU discovery and mapping. The fake NVML here runs the same cases the real one answers on a
GPU machine; test_real_nvml checks the real library on whatever machine runs the suite."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from campugrid.agent.gpus import GpuPolicy, apple_gpu, discover
from campugrid.agent.sandboxing import gpus_still_free
from campugrid.protocol import agent_pb2 as pb
from campugrid.sandbox.podman_runsc import gpu_devices

MB = 1024 * 1024


class FakeNvml:
    """Two GPUs; the second is shared with a model server holding 30 GB."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, procs=None):
        self.devices = [
            {"uuid": "GPU-aaa", "name": b"NVIDIA GeForce RTX 4090", "total": 24564, "free": 23000,
             "cc": (8, 9), "temp": 41, "minor": 0, "procs": []},
            {"uuid": "GPU-bbb", "name": "NVIDIA A100-SXM4-80GB", "total": 81920, "free": 51000,
             "cc": (8, 0), "temp": 55, "minor": 3, "procs": procs or []},
        ]
        self.shut = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut = True
    def nvmlSystemGetDriverVersion(self): return "550.54.15"
    def nvmlDeviceGetCount(self): return len(self.devices)
    def nvmlDeviceGetHandleByIndex(self, i): return self.devices[i]
    def nvmlDeviceGetUUID(self, h): return h["uuid"]
    def nvmlDeviceGetName(self, h): return h["name"]
    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=h["total"] * MB, free=h["free"] * MB,
                                     used=(h["total"] - h["free"]) * MB)
    def nvmlDeviceGetCudaComputeCapability(self, h): return h["cc"]
    def nvmlDeviceGetTemperature(self, h, _): return h["temp"]
    def nvmlDeviceGetMinorNumber(self, h): return h["minor"]
    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p) for p in h["procs"]]
    def nvmlDeviceGetGraphicsRunningProcesses(self, h): return []


def test_every_gpu_is_reported_with_memory_held_outside_the_platform():
    nvml = FakeNvml()
    found = discover(GpuPolicy(), nvml)
    assert [g.uuid for g in found.gpus] == ["GPU-aaa", "GPU-bbb"]
    a100 = found.gpus[1]
    assert a100.memory_total_mb == 81920 and a100.memory_free_mb == 51000
    assert a100.compute_capability == "8.0" and a100.minor == 3 and a100.kind == "nvidia"
    assert a100.driver_version == "550.54.15" and a100.temperature_c == 55
    assert found.gpus[0].name == "NVIDIA GeForce RTX 4090"
    assert nvml.shut


def test_the_owners_policy_limits_what_is_offered():
    found = discover(GpuPolicy(allow=("1",), reserve_mb=4000), FakeNvml())
    assert [(g.uuid, g.memory_free_mb) for g in found.gpus] == [("GPU-bbb", 47000)]
    assert "GPU 0 not offered" in found.note
    import os
    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    guarded = discover(GpuPolicy(protected=(me,)), FakeNvml(procs=[os.getpid()]))
    assert [g.uuid for g in guarded.gpus] == ["GPU-aaa"]
    assert f"in use by protected {me}" in guarded.note


def test_real_nvml():
    found = discover(GpuPolicy())
    if not found.gpus:
        assert found.note.startswith("no NVIDIA GPU: ")  # clean, not an exception
        return
    for g in found.gpus:  # pragma: no cover - GPU machines only
        assert g.uuid.startswith("GPU-") and g.memory_total_mb > 0 and g.compute_capability


def test_apple_silicon_memory_is_marked_shared():
    g = apple_gpu("arm64", 32768)
    assert g.kind == "apple" and g.shared_memory and g.memory_total_mb == 32768


def test_only_reserved_gpus_are_mapped(tmp_path):
    nodes = gpu_devices((("GPU-bbb", 3),), cdi_dirs=(tmp_path,),
                        exists=lambda p: p in ("/dev/nvidiactl", "/dev/nvidia-uvm"))
    assert nodes == ["--device", "/dev/nvidia3", "--device", "/dev/nvidiactl",
                     "--device", "/dev/nvidia-uvm", "--env", "NVIDIA_VISIBLE_DEVICES=GPU-bbb",
                     "--env", "CUDA_VISIBLE_DEVICES=GPU-bbb"]
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    cdi = gpu_devices((("GPU-bbb", 3),), cdi_dirs=(tmp_path,))
    assert cdi[:2] == ["--device", "nvidia.com/gpu=GPU-bbb"] and "/dev/nvidia0" not in cdi
    assert gpu_devices(()) == []


@pytest.mark.parametrize(("free", "why"), [(20000, ""), (9000, "has only 9000 MB free now")])
def test_the_agent_rechecks_free_memory_before_starting(free, why):
    lease = pb.LeaseReply(gpu_uuids=["GPU-aaa"], gpu_memory_mb=10000)
    mapped, reason = gpus_still_free(lease, [pb.Gpu(uuid="GPU-aaa", memory_free_mb=free, minor=2)])
    assert (mapped, why in reason if why else reason == "") == ((("GPU-aaa", 2),) if not why else (), True)
    gone = gpus_still_free(lease, [])
    assert gone[0] == () and "no longer offered" in gone[1]


def test_the_speed_score_is_a_matmul_rate_and_falls_back_to_the_cpu():
    from campugrid.agent.speed import matmul_gflops

    # A rate, not a time: positive and finite at any size (which size is faster depends on
    # the machine's load, so that is for bench/, not for a test).
    rates = [matmul_gflops(n=64, repeats=3), matmul_gflops(n=512, repeats=3)]
    assert all(0 < r < float("inf") for r in rates), rates
    # No CUDA here: asking for the GPU measures the CPU instead of failing.
    assert matmul_gflops(gpu=True, n=256, repeats=2) > 0
