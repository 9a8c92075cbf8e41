"""Worker of tests/test_corrupt_backups.py: an ordinary 2-worker Keras `fit` whose backups a test damages.

Usage: corrupt_fit.py OUT_ROOT CASE[,CASE...]. Each case trains the same
script in turn into OUT_ROOT/CASE/backup (the backups the test left there,
damaged or not): an MLP on a shuffled `tf.data` pipeline, `fit(epochs=2)`
of 8 steps each, Keras's EarlyStopping (state in every backup),
`tfdp.callbacks.BackupAndRestore(save_freq=3, max_to_keep=2,
delete_checkpoint=False)`, op determinism on. Before each case worker 0
prints `CASE <name>`; each worker writes its final weights to
OUT_ROOT/CASE/weights-<worker>.npy and prints `RESULT case=<name>
restored=<step>`. Case `prepare` instead ends the process (every worker,
exit 0) after global step 10, with backups at steps 6 and 9 left behind;
case `wider` is another model (17 hidden units instead of 16).
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf
import tfdp

STOP_AT = 10


class StopAt(keras.callbacks.Callback):
  """Ends the process after global step STOP_AT (the backup of step 9 is written: saves are synchronous)."""

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) == STOP_AT:
      sys.stdout.flush()
      os._exit(0)  # pylint: disable=protected-access


def train(out_dir, name, strategy, worker):
  keras.utils.set_random_seed(5)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 6)).astype("float32")
  y = (x.sum(axis=1) > 0).astype("int64")
  ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=1).batch(8).prefetch(1)
  with strategy.scope():
    # Named: the variables' paths (a backup's keys) are the same in every case of the process.
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(17 if name == "wider" else 16, activation="relu",
                                                 name="hidden"),
                              keras.layers.Dense(2, name="out")], name="mlp")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  backup = tfdp.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=3,
                                           max_to_keep=2, delete_checkpoint=False)
  callbacks = [keras.callbacks.EarlyStopping(monitor="loss", patience=100), backup]
  if name == "prepare":
    callbacks.append(StopAt())
  model.fit(ds, epochs=2, callbacks=callbacks, verbose=0)
  if name == "prepare":
    raise AssertionError(f"fit ended before step {STOP_AT}")
  np.save(os.path.join(out_dir, f"weights-{worker}.npy"),
          np.concatenate([w.numpy().ravel() for w in model.weights]))
  print(f"RESULT case={name} worker={worker} steps={int(model.optimizer.iterations.numpy())} "
        f"restored={backup.restored_step}", flush=True)


def main(out_root, cases):
  strategy = tfdp.make_strategy()
  tf.config.experimental.enable_op_determinism()
  worker = tfdp.cluster.resolve(strategy).index
  for name in cases.split(","):
    if worker == 0:
      print(f"CASE {name}", flush=True)
    train(os.path.join(out_root, name), name, strategy, worker)


if __name__ == "__main__":
  main(*sys.argv[1:])
