"""One epoch of a small Keras model on a separable problem; prints what it learned."""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 4)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("float32")
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer=tf.keras.optimizers.Adam(0.1), loss="binary_crossentropy",
              metrics=["accuracy"])
history = model.fit(x, y, epochs=3, batch_size=64, verbose=0)
print(json.dumps({"tensorflow": tf.__version__,
                  "accuracy": round(float(history.history["accuracy"][-1]), 3)}))
