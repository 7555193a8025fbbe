"""The speed score a machine reports when it joins: a short matmul benchmark, in GFLOP/s.

It ranks machines against each other (heavy shards go to the faster half), so every agent
measures the same way: float32 matmul with NumPy on the CPU, or on the first GPU when
PyTorch with CUDA is importable (the GPU is then what jobs would use). About a second.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("campugrid.agent")


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
