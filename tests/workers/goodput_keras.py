"""A plain Keras script with tfdp's BackupAndRestore, for goodput: it SIGKILLs itself at step KILL_AT of a fresh run.

Usage: goodput_keras.py BACKUP_DIR KILL_AT. It trains a tiny model for 4
epochs of 10 steps, backed up every 5 steps; the backups are deleted when
training completes (Keras's default `delete_checkpoint=True`). A run that
restored nothing SIGKILLs itself right after step KILL_AT. Each line it
prints on stdout that holds "goodput" is followed by whether BACKUP_DIR and
its goodput.json existed when the line was printed.
"""

import os
import signal
import sys

import keras
import numpy as np
import tfdp


class _Stdout:
  """sys.stdout that notes, after any goodput line, whether the backups were still there."""

  def __init__(self, stream, backup_dir):
    self.stream, self.backup_dir = stream, backup_dir

  def write(self, text):
    if "goodput" in text:
      summary = os.path.join(self.backup_dir, "goodput.json")
      text += (f" [backup_dir exists: {os.path.isdir(self.backup_dir)}, "
               f"goodput.json exists: {os.path.exists(summary)}]")
    return self.stream.write(text)

  def __getattr__(self, name):
    return getattr(self.stream, name)


class _KillAt(keras.callbacks.Callback):

  def __init__(self, backup, step):
    super().__init__()
    self.backup, self.step = backup, step

  def on_train_batch_begin(self, batch, logs=None):
    # The next step begins: every callback, the backup last, has ended step `step`.
    if (self.backup.restored_step is None
        and int(self.model.optimizer.iterations.numpy()) == self.step):
      os.kill(os.getpid(), signal.SIGKILL)


def main(backup_dir, kill_at):
  sys.stdout = _Stdout(sys.stdout, backup_dir)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(80, 4)).astype("float32")
  y = x.sum(axis=1, keepdims=True)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")], name="m")
  model.compile(keras.optimizers.SGD(0.01), "mse")
  backup = tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=5)
  # The kill comes after the backup's batch end: the step is counted before it.
  model.fit(x, y, batch_size=8, epochs=4, verbose=0,
            callbacks=[backup, _KillAt(backup, int(kill_at))])
  print(f"trained to step {int(model.optimizer.iterations.numpy())}, "
        f"restored {backup.restored_step}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
