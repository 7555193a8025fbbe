"""A hyperparameter sweep as a sharded job (see job.json): each shard is one setting.

With "shard_mode": "serve" (job.json) the process starts once per machine, makes the data
once, and serves shards through hooks.serve_shards. With "process" it runs once per shard,
reading the shard from $CAMPUGRID_SHARD_PAYLOAD and printing its result as its last line.
"""

import json
import os
import socket

import numpy as np

rng = np.random.default_rng(0)
X = rng.standard_normal((2000, 20))
true_w = rng.standard_normal(20)
y = (X @ true_w + 0.5 * rng.standard_normal(2000) > 0).astype(float)


def evaluate(shard: dict) -> dict:
    lr, epochs = float(shard["lr"]), int(shard.get("epochs", 50))
    w = np.zeros(X.shape[1])
    for _ in range(epochs):
        p = 1 / (1 + np.exp(-(X @ w)))
        w -= lr * X.T @ (p - y) / len(y)
    p = np.clip(1 / (1 + np.exp(-(X @ w))), 1e-9, 1 - 1e-9)
    loss = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    return {"lr": lr, "epochs": epochs, "loss": round(loss, 6),
            "sandbox": socket.gethostname(), "pid": os.getpid()}


if __name__ == "__main__":
    if "CAMPUGRID_SHARD_PAYLOAD" in os.environ:  # "shard_mode": "process"
        print(json.dumps(evaluate(json.loads(os.environ["CAMPUGRID_SHARD_PAYLOAD"]))))
    else:  # "shard_mode": "serve"
        from campugrid import hooks

        hooks.serve_shards(evaluate)
