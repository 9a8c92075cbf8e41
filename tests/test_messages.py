"""Failures a new user meets first end in one line that names the real fix (issue 24)."""

import re

import keras
import numpy as np
import pytest

from tfdp import callbacks
from tfdp import errors


def test_a_backup_dir_that_is_a_file_is_one_config_error_before_tensorflow_touches_it(tmp_path):
  path = tmp_path / "backup"
  path.write_text("not a directory")
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
  with pytest.raises(errors.ConfigError) as e:
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0,
              callbacks=[callbacks.BackupAndRestore(str(path))])
  assert str(e.value) == (f"{path} is a file, not a directory: pass a directory for the "
                          "checkpoints (it is created if missing).")
  assert path.read_text() == "not a directory"


def test_a_resume_announces_itself_once_on_the_chief(tmp_path, capsys):
  """Plain fit killed (here: stopped) mid-epoch: the rerun says what it restored, where, and the data."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = np.random.RandomState(0).normal(size=(64, 2)).astype("float32")
  y = x.sum(axis=1, keepdims=True)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(8)

  def fit(epochs, cbs=()):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")], name="m")
    model.compile("sgd", "mse")
    backup = callbacks.BackupAndRestore(str(tmp_path), save_freq=3, delete_checkpoint=False)
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=[backup, *cbs])

  class Stop(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if int(self.model.optimizer.iterations.numpy()) == 11:
        self.model.stop_training = True

  fit(3, [Stop()])
  assert "resumed from" not in capsys.readouterr().out
  fit(3)
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("tfdp: resumed")]
  assert len(lines) == 1 and re.fullmatch(
      rf"tfdp: resumed from {re.escape(str(tmp_path))}/ckpt-9 at step 9 \(epoch 2, step 1 of it; "
      r"data position restored, [\d.]+ KB per worker\)", lines[0]), lines
