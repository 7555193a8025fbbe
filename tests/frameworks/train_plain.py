"""A plain PyTorch loop as researchers write one: every 10 steps it saves ckpt/step_N.pt, and
on start it resumes from the newest it finds. Nothing of campugrid in it; the job names the
folder ("checkpoints": {"dir": "/app/ckpt", "match": "step_*.pt"}). STEP_SECONDS slows each
step down, so that a test can stop it midway."""
import glob
import hashlib
import json
import os
import time

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
os.makedirs("ckpt", exist_ok=True)
start = 0
found = sorted(glob.glob("ckpt/step_*.pt"))
if found:
    state = torch.load(found[-1])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    start = state["step"]
    print(f"resumed from {found[-1]}", flush=True)
for step in range(start, 60):
    x = torch.randn(32, 8)
    y = (x.sum(1, keepdim=True) > 0).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(float(os.environ.get("STEP_SECONDS", "0")))
    if (step + 1) % 10 == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                    "rng": torch.get_rng_state()}, f"ckpt/step_{step + 1:05d}.pt")
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(json.dumps({"framework": "plain", "weights": hashlib.sha256(weights).hexdigest()}))
