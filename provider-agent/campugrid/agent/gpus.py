"""What GPUs this machine offers, through NVML (nvidia-ml-py), and under the owner's policy.

No NVIDIA driver is a normal answer (CPU only), never an error. Apple silicon is reported
with its memory marked as shared with the system. GPUs running one of the owner's protected
processes are not offered at all, and the owner's reserve is kept free on the others.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
from pathlib import Path
from typing import Any

from campugrid.agent.messages import Gpu

MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class GpuPolicy:
    """The owner's say: which GPUs (index or uuid; None = all), memory to leave free on each,
    and processes (by name) whose GPUs must not be used while they run."""

    allow: tuple[str, ...] | None = None
    reserve_mb: int = 0
    protected: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Discovery:
    gpus: tuple[Gpu, ...]
    note: str  # why there are none, or what was left out


def discover(policy: GpuPolicy = GpuPolicy(), nvml: Any = None) -> Discovery:
    if platform.system() == "Darwin":
        return Discovery((apple_gpu(platform.machine(), _system_memory_mb()),), "Apple GPU")
    try:
        nvml = nvml or importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as e:
        return Discovery((), f"no NVIDIA GPU: {type(e).__name__.removeprefix('NVMLError_')}")
    try:
        return _nvidia(nvml, policy)
    finally:
        nvml.nvmlShutdown()


def _nvidia(nvml: Any, policy: GpuPolicy) -> Discovery:
    driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
    offered, skipped = [], []
    for index in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml_text(nvml.nvmlDeviceGetUUID(h))
        if policy.allow is not None and str(index) not in policy.allow and uuid not in policy.allow:
            skipped.append(f"GPU {index} not offered by the owner")
            continue
        holders = [_process_name(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)]
        holders += [_process_name(p.pid) for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(h)]
        busy = sorted({n for n in holders if n in policy.protected})
        if busy:
            skipped.append(f"GPU {index} in use by protected {', '.join(busy)}")
            continue
        mem = nvml.nvmlDeviceGetMemoryInfo(h)  # `used` includes every process outside campugrid
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        offered.append(Gpu(
            uuid=uuid, name=nvml_text(nvml.nvmlDeviceGetName(h)), kind="nvidia",
            memory_total_mb=mem.total // MB,
            memory_free_mb=max(0, mem.free // MB - policy.reserve_mb),
            compute_capability=f"{major}.{minor}",
            temperature_c=nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            driver_version=driver, minor=nvml.nvmlDeviceGetMinorNumber(h)))
    return Discovery(tuple(offered), "; ".join(skipped))


def apple_gpu(machine: str, memory_mb: int) -> Gpu:
    return Gpu(uuid=f"apple-{machine}", name=f"Apple {machine} GPU", kind="apple",
               memory_total_mb=memory_mb, memory_free_mb=memory_mb, shared_memory=True)


def nvml_text(value: str | bytes) -> str:
    """NVML's strings: str, or bytes from older bindings."""
    return value.decode() if isinstance(value, bytes) else value


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"


def _system_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MB)
    except (ValueError, OSError):
        return 0
