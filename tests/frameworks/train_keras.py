"""A Keras script (on its PyTorch backend) as researchers write one: BackupAndRestore in
backup/, shuffled batches, nothing of campugrid in it. STEP_SECONDS slows each step down, so
that a test can stop it midway; DRAIN_AT_STEP drains it (SIGTERM to itself) once that many
steps are done."""
import hashlib
import json
import os
import signal
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
import keras
import numpy as np

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
y = (x.sum(1) > 0).astype("float32")
pause = float(os.environ.get("STEP_SECONDS", "0"))


class Pace(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(pause)
        if os.environ.get("DRAIN_AT_STEP") == str(int(self.model.optimizer.iterations)):
            os.kill(os.getpid(), signal.SIGTERM)


model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dropout(0.1), keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
model.fit(x, y, epochs=4, batch_size=32, verbose=0, shuffle=True,
          callbacks=[keras.callbacks.BackupAndRestore("backup"), Pace()])
weights = b"".join(np.asarray(w).tobytes() for w in model.get_weights())
print(json.dumps({"framework": "keras", "weights": hashlib.sha256(weights).hexdigest()}))
