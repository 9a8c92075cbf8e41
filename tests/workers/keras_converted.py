"""A plain Keras script (MLP classifier: model.fit, then evaluate and predict) converted to tfdp as the README says.

Usage: keras_converted.py BACKUP_DIR SAVE_FREQ DELETE DOUBLE [EPOCHS]. Env
TFDP_TEST_SLOW_FROM=N sleeps after each step from global step N on, so a test
can kill it mid-run.
"""

import sys

import keras
import numpy as np
import tfdp

import slow_steps  # tests/workers/


def load_data(n, seed):
  """Ten Gaussian clusters (the same centers for every seed), `n` noisy points."""
  centers = np.random.default_rng(0).normal(size=(10, 16)).astype("float32") * 2
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 10, size=n)
  return centers[labels] + rng.normal(size=(n, 16)).astype("float32"), labels


def main(backup_dir, save_freq, delete, double, epochs=8):
  x, y = load_data(1024, seed=1)
  x_test, y_test = load_data(256, seed=2)
  strategy = tfdp.make_strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(10)])
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  backup = tfdp.callbacks.BackupAndRestore(
      backup_dir, save_freq=save_freq if save_freq == "epoch" else int(save_freq),
      delete_checkpoint=delete == "1", double_checkpoint=double == "1")
  model.fit(x, y, batch_size=64, epochs=int(epochs), callbacks=[backup, slow_steps.SlowFrom(0.15)],
            verbose=0)
  _, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
  predicted = model.predict(x_test, batch_size=64, verbose=0).argmax(axis=1)
  assert abs((predicted == y_test).mean() - accuracy) < 1e-6, "predict disagrees with evaluate"
  print(f"test_accuracy={accuracy:.3f} step={int(model.optimizer.iterations.numpy())} "
        f"restored_step={backup.restored_step}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
