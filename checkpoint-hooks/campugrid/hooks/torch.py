"""PyTorch adapter: model + optimizer + epoch (+ RNG state) in one checkpoint. Imports torch
only when called, so the hooks stay importable in any image."""

from __future__ import annotations

import os
from typing import Any

from campugrid import hooks


def save(epoch: int, model: Any, optimizer: Any = None, extra: dict[str, Any] | None = None,
         root: str | os.PathLike[str] | None = None) -> None:
    import torch

    state = {"epoch": epoch, "model": model.state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "rng": torch.get_rng_state(), "extra": extra or {}}
    with hooks.save(epoch, {"framework": "torch"}, root) as folder:
        torch.save(state, folder / "state.pt")


def restore(model: Any, optimizer: Any = None,
            root: str | os.PathLike[str] | None = None) -> int | None:
    """Load the latest checkpoint into model/optimizer; return its epoch, or None."""
    import torch

    found = hooks.latest(root)
    if found is None:
        return None
    # weights_only: a checkpoint comes from an untrusted machine; never unpickle code from it.
    state = torch.load(found.file("state.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["epoch"])
