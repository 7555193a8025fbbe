"""Logistic regression on a synthetic dataset, trained with NumPy, one checkpoint per epoch.

Deterministic: the data and the initial weights come from a fixed seed, and each epoch's
shuffle is seeded by the epoch number, so a run resumed from epoch k's checkpoint ends with
exactly the same weights as an uninterrupted one. Prints one JSON line at the end.
"""

import hashlib
import json
import os
import time

import numpy as np

from campugrid import hooks

EPOCHS = int(os.environ.get("EPOCHS", "10"))
EPOCH_SECONDS = float(os.environ.get("EPOCH_SECONDS", "2"))  # padding: a "real" epoch's length
N, D, LR, BATCH = 4000, 32, 0.1, 100

data_rng = np.random.default_rng(1234)
X = data_rng.normal(size=(N, D))
true_w = data_rng.normal(size=D)
y = (X @ true_w + 0.5 * data_rng.normal(size=N) > 0).astype(np.float64)

hooks.install_sigterm_handler()  # SIGTERM (a drain) ends the epoch, saves, and stops
state = hooks.restore()
if state is not None:
    w = np.load(state.file("w.npy"))
    start = state.epoch + 1
    print(f"resumed from the checkpoint of epoch {state.epoch}", flush=True)
else:
    w = np.random.default_rng(99).normal(scale=0.01, size=D)
    start = 0

for epoch in range(start, EPOCHS):
    began = time.monotonic()
    order = np.random.default_rng(epoch).permutation(N)
    for i in range(0, N, BATCH):
        idx = order[i:i + BATCH]
        p = 1 / (1 + np.exp(-X[idx] @ w))
        w -= LR * X[idx].T @ (p - y[idx]) / len(idx)
    loss = float(np.mean(np.logaddexp(0, -(2 * y - 1) * (X @ w))))
    time.sleep(max(0.0, EPOCH_SECONDS - (time.monotonic() - began)))
    with hooks.save(epoch, {"loss": loss}) as folder:
        np.save(folder / "w.npy", w)
    print(f"epoch {epoch} loss {loss:.6f}", flush=True)
    if hooks.stop_requested():
        print(f"asked to stop: checkpoint of epoch {epoch} is saved", flush=True)
        raise SystemExit(0)

os.makedirs("/output", exist_ok=True)
np.save("/output/w.npy", w)
accuracy = float(np.mean(((X @ w) > 0) == (y > 0)))
print(json.dumps({"epochs": EPOCHS, "accuracy": round(accuracy, 4),
                  "weights_sha256": hashlib.sha256(w.tobytes()).hexdigest()}), flush=True)
