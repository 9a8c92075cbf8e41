"""Bugs found when each concept got one owner (issue 21): each test failed on 3641f36."""

import json
import os
import socket

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import callbacks
from tfdp import data
from tfdp import errors
from tfdp.callbacks import fit as training
from tfdp.checkpoint.format import layout as layout_lib
from tests import save_faults

X = np.random.RandomState(0).normal(size=(40, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _model():
  keras.utils.set_random_seed(0)
  # Fixed names: a model built again restores the same variables.
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")], name="m")
  model.compile(keras.optimizers.SGD(0.01), "mse")
  return model


def test_backup_and_restore_takes_keep_best_as_the_string_its_docstring_shows(tmp_path):
  """`keep_best="val_loss:min:2"` keeps the two best backups by val_loss, and the newest."""
  backup = callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False,
                                      keep_best="val_loss:min:2", max_to_keep=1)
  model = _model()
  # Validation targets the model unlearns: the best backups are the first ones.
  history = model.fit(X, Y, batch_size=8, epochs=6, validation_data=(X[:8], -Y[:8]),
                      verbose=0, callbacks=[backup])
  val = history.history["val_loss"]
  best = sorted(range(6), key=lambda e: val[e])[:2]
  expected = sorted({5 * (e + 1) for e in best} | {30})
  assert best != [4, 5]  # Not trivially the newest.
  assert [layout_lib.number_of(p) for p in backup.manager.checkpoints] == expected
  with pytest.raises(errors.ConfigError, match="METRIC:min"):
    callbacks.BackupAndRestore(str(tmp_path / "x"), keep_best="val_loss:lowest:2")


def test_a_refused_chief_writes_nothing_not_even_the_tiers_token(tmp_path):
  """The lease comes before any write: a second job on a busy directory leaves it as it was."""
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  # A live job of this host (pid 1 is always alive) holds the directory.
  lease = {"session": "other-job", "host": socket.gethostname(), "pid": 1,
           "heartbeat": 1e12}
  (model_dir / layout_lib.LEASE_FILENAME).write_text(json.dumps(lease))
  before = sorted(os.listdir(model_dir))
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  with pytest.raises(errors.CheckpointError, match="in use by another"):
    tfdp.CheckpointManager(ckpt, str(model_dir), local_checkpoint_every_steps=5,
                           local_checkpoint_dir=str(tmp_path / "local"))
  assert sorted(os.listdir(model_dir)) == before
  assert not (model_dir / layout_lib.TIERS_FILENAME).exists()


def _tfdp_fit(model_dir, train_steps):
  source = data.ArraySource((X, Y))
  model = _model()
  backup = callbacks.BackupAndRestore(model_dir, save_freq=10, delete_checkpoint=False)
  training.fit(model, lambda first: data.distribute(tf.distribute.get_strategy(), source,
                                                    global_batch_size=4, seed=0,
                                                    start_step=first),
               train_steps=train_steps, steps_per_epoch=100, callbacks=[backup], verbose=0)
  return backup


def _step_in_epoch(prefix):
  return int(tf.train.load_checkpoint(prefix).get_tensor(
      "keras_step_in_epoch/.ATTRIBUTES/VARIABLE_VALUE"))


def test_tfdp_fit_records_the_step_within_the_epoch_not_since_the_fit_began(tmp_path):
  """Resumed at step 30 and stopped at 60 of a 100-step epoch, the backup says 60, as an unstopped run's."""
  stopped = str(tmp_path / "stopped")
  _tfdp_fit(stopped, 30)
  resumed = _tfdp_fit(stopped, 60)
  assert resumed.restored_step == 30
  unstopped = _tfdp_fit(str(tmp_path / "unstopped"), 60)
  assert _step_in_epoch(unstopped.manager.latest_checkpoint) == 60
  assert _step_in_epoch(resumed.manager.latest_checkpoint) == 60


def test_a_failed_async_save_gives_back_its_save_counter_increment(tmp_path):
  """TF numbers saves by save_counter: a save that never committed must not use up a number."""
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  manager = tfdp.CheckpointManager(ckpt, str(tmp_path), async_save=True)
  manager.save()
  manager.sync()

  def fail(phase, worker):
    if phase == "after_shard":
      raise OSError("disk went away")

  undo = save_faults.install(fail)
  try:
    assert manager.save().endswith("ckpt-2")
    with pytest.raises(OSError, match="disk went away"):
      manager.sync()
  finally:
    undo()
  assert int(ckpt.save_counter.numpy()) == 1
  assert manager.save().endswith("ckpt-2")
  manager.close()
  assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1", "ckpt-2"]
  assert int(ckpt.save_counter.numpy()) == 2


class _StopAt(keras.callbacks.Callback):
  """Raises after global batch `batch` of epoch `epoch` (a crash mid-epoch)."""

  def __init__(self, epoch, batch):
    super().__init__()
    self.epoch, self.batch, self._current = epoch, batch, None

  def on_epoch_begin(self, epoch, logs=None):
    self._current = epoch

  def on_train_batch_end(self, batch, logs=None):
    if (self._current, batch) == (self.epoch, self.batch):
      raise RuntimeError("crash")


def test_a_resume_without_the_data_hooks_says_the_data_position_is_lost(tmp_path, monkeypatch):
  """A probe-failed (or disabled) fit_data_state warns at import and again at every resume it costs."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  from tfdp import compat  # pylint: disable=g-import-not-at-top
  backup_dir = str(tmp_path / "backup")
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(40, seed=1).batch(8)
  with pytest.raises(RuntimeError, match="crash"):
    _model().fit(dataset, epochs=3, verbose=0, callbacks=[
        callbacks.BackupAndRestore(backup_dir, save_freq=2), _StopAt(1, 2)])
  warnings = []
  compat.revert()
  monkeypatch.setenv(compat.DISABLE_ENV, "fit_data_state")
  try:
    compat.apply()
    monkeypatch.setattr(logging, "warning", lambda msg, *a: warnings.append(msg % a))
    _model().fit(dataset, epochs=3, verbose=0,
                 callbacks=[callbacks.BackupAndRestore(backup_dir, save_freq=2)])
  finally:
    compat.revert()
    monkeypatch.delenv(compat.DISABLE_ENV)
    compat.apply()
  lost = [w for w in warnings if "holds the data position" in w]
  assert len(lost) == 1 and "fit_data_state is disabled" in lost[0], warnings
