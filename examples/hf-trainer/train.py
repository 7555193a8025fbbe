"""A Hugging Face Trainer script as researchers write one: a tiny GPT-2 from a config (nothing
downloaded), checkpoints every 10 steps in outputs/, nothing of campugrid in it. Its last line,
the job's result, is a digest of the trained weights: a run stopped and resumed on another
machine ends with the same one. STEP_SECONDS slows each step down (the tests stop it midway)."""
import hashlib
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (256, 16))]
pause = float(os.environ.get("STEP_SECONDS", "0")) / 8  # per sample; 8 to a step


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return len(data)

    def __getitem__(self, i):
        time.sleep(pause)
        return data[i]


args = TrainingArguments(output_dir="outputs", max_steps=40, save_steps=10, save_total_limit=2,
                         per_device_train_batch_size=8, seed=0, report_to=[], use_cpu=True,
                         logging_steps=1000, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Samples()).train()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(json.dumps({"framework": "transformers", "weights": hashlib.sha256(weights).hexdigest()}))
