"""The speed score a machine reports when it joins: a short matmul benchmark, in GFLOP/s.

It ranks machines against each other (heavy shards go to the faster half), so every agent
measures the same way: float32 matmul with NumPy on the CPU, or on the first GPU when
PyTorch with CUDA is importable (the GPU is then what jobs would use). About a second.

The agent measures in a child interpreter (`in_child`): NumPy's thread pools and buffers,
and PyTorch's CUDA context with the GPU memory it holds, end with the child instead of
staying in the agent for its whole life (where NVML would count the agent as a process
using the GPU).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

log = logging.getLogger("campugrid.agent")


def in_child(*, gpu: bool = False, timeout_s: float = 300) -> float:
    """matmul_gflops in a fresh interpreter; 0.0 (ranked slowest) if it cannot run."""
    code = ("import sys; from campugrid.agent.speed import matmul_gflops; "
            "print(matmul_gflops(gpu=sys.argv[1] == 'gpu'))")
    try:
        out = subprocess.run([sys.executable, "-c", code, "gpu" if gpu else "cpu"],
                             capture_output=True, text=True, timeout=timeout_s, check=False)
        return float(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        log.warning("the speed benchmark did not run (%s); this machine ranks as slowest", e)
        return 0.0


def matmul_gflops(*, gpu: bool = False, n: int = 512, repeats: int = 5) -> float:
    """`gpu`: the machine offers GPUs; measure one of them if PyTorch can."""
    if gpu:
        try:
            return _torch_cuda(n * 4, repeats)
        except Exception as e:  # no torch, no CUDA, a driver problem: the CPU score stands
            log.info("GPU not benchmarked (%s); the speed score is the CPU's", e)
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up: thread pools, page faults
    return _best(lambda: a @ b, n, repeats)


def _torch_cuda(n: int, repeats: int) -> float:
    import torch  # optional; not a dependency of the agent

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA")
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")

    def run() -> Any:
        out = a @ b
        torch.cuda.synchronize()
        return out

    run()
    return _best(run, n, repeats)


def _best(run: Any, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return round(2 * n**3 / max(best, 1e-9) / 1e9, 2)
