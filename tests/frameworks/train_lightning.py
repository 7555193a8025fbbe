"""A PyTorch Lightning script as researchers write one: ModelCheckpoint at every epoch's end in
checkpoints/, a shuffled DataLoader, nothing of campugrid in it. STEP_SECONDS slows each step
down, so that a test can stop it midway; DRAIN_AT_STEP drains it (SIGTERM to itself) during
that step."""
import hashlib
import json
import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

L.seed_everything(0)
x = torch.randn(512, 8)
y = (x.sum(1, keepdim=True) > 0).float()
pause = float(os.environ.get("STEP_SECONDS", "0"))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def training_step(self, batch, i):
        time.sleep(pause)
        if os.environ.get("DRAIN_AT_STEP") == str(self.global_step):
            os.kill(os.getpid(), signal.SIGTERM)
        xb, yb = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(xb), yb)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


model = Model()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                     shuffle=True)
trainer = L.Trainer(max_epochs=4, deterministic=True, logger=False, enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[ModelCheckpoint(dirpath="checkpoints", save_top_k=-1)])
trainer.fit(model, loader)
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(json.dumps({"framework": "lightning", "weights": hashlib.sha256(weights).hexdigest()}))
