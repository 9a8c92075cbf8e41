"""What a backup's state beyond the model costs the training step: the callbacks' and the metrics' parts, per save.

Usage: python scripts/bench_run_state.py [--epochs=20] [--steps=50]

A small CNN fit (8x8 images, batch 16) with TensorBoard, ModelCheckpoint,
EarlyStopping, ReduceLROnPlateau and CSVLogger beside
`tfdp.callbacks.BackupAndRestore`: after each step, the callbacks' state
(`tfdp.resume.trackables.CallbackStates`: JSON, the CSV text read back, TensorBoard's
writers flushed) and the metrics' (`MetricStates`) are taken as a save takes
them, and timed, against the step itself. The median of each, in one run.
"""

import argparse
import os
import statistics
import tempfile
import time

import keras
import numpy as np
import tfdp


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args()
  out = tempfile.mkdtemp(prefix="tfdp-run-state-")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16 * args.steps, 8, 8, 3)).astype("float32")
  y = rng.integers(0, 4, len(x))
  model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
  model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  backup = tfdp.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=False)
  timings = {"step": [], "callbacks": [], "metrics": []}

  class Time(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      timings["step"].append(time.perf_counter() - self.t)
      for name, part in (("callbacks", backup.position.callbacks),
                         ("metrics", backup.position.metrics)):
        t = time.perf_counter()
        part._serialize_to_tensors()  # pylint: disable=protected-access
        timings[name].append(time.perf_counter() - t)

  model.fit(x, y, batch_size=16, epochs=args.epochs, validation_split=0.1, verbose=0, callbacks=[
      keras.callbacks.TensorBoard(os.path.join(out, "tb")),
      keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras"), save_best_only=True),
      keras.callbacks.EarlyStopping(patience=100), keras.callbacks.ReduceLROnPlateau(),
      keras.callbacks.CSVLogger(os.path.join(out, "log.csv")), Time(), backup])
  skip = args.steps  # the first epoch traces
  for name, values in timings.items():
    print(f"{name:10} median {1e3 * statistics.median(values[skip:]):.3f} ms over "
          f"{len(values) - skip} steps")


if __name__ == "__main__":
  main()
