"""What BackupAndRestore checks and says of its backups: an unwritable backup_dir, the interval "auto" chose, a data position that dominates."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.callbacks import backup_watch
from tfdp import callbacks
from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint.schedule import policy


def test_a_backup_dir_it_cannot_write_is_one_config_error_when_the_callback_is_built(tmp_path):
  a_file = tmp_path / "a-file"
  a_file.write_text("")
  for path in ("/proc/x", str(a_file / "backup")):
    with pytest.raises(errors.ConfigError, match=r"cannot write backup_dir .*: pass a directory"):
      callbacks.BackupAndRestore(path)
  # A writable one is left as it was: nothing is made before training.
  callbacks.BackupAndRestore(str(tmp_path / "new" / "backup"))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def _backup(save_freq=20):
  manager = types.SimpleNamespace(local_tuning=None, latest_checkpoint=None)
  return types.SimpleNamespace(manager=manager, local_checkpoint_every_steps="auto",
                               save_freq=save_freq, checkpoint_overhead=0.02)


def test_the_interval_auto_chose_is_said_at_each_new_choice_and_a_sparser_one_warned_once(
    capsys, caplog, monkeypatch):
  """The chief says each of the local cadence's choices once, and warns once of a sparser one."""
  me = cluster.Worker(index=0, count=1)
  # A save costs 6 ms; the steps' times decide the interval at steps 25, 50, 75, 100.
  tier = policy.LocalCadence("auto", 0.02, me, costs=lambda: [(0.004, 0.002)] * 3)
  backup, watch = _backup(), backup_watch.Watch()
  clock = [0.0]
  monkeypatch.setattr(policy.time, "perf_counter", lambda: clock[0])
  for step in range(1, 101):
    # 10 ms steps (an interval of 30), then 37.5 ms ones (8), then 7.5 ms (40).
    clock[0] += 0.010 if step <= 50 else 0.0375 if step <= 75 else 0.0075
    tier.due(step)
    backup.manager.local_tuning = tier.tuning
    watch.batch_begin(backup)
  lines = capsys.readouterr().out.splitlines()
  assert [int(l.split()[4]) for l in lines] == [30, 8, 40], lines
  assert lines[0].startswith("tfdp: local saves every 30 step(s) (local_checkpoint_every_steps="
                             "'auto': a save costs 6.0 ms, blocked plus its writer's CPU"), lines
  warned = [r.getMessage() for r in caplog.records if "less often than the backups" in r.getMessage()]
  assert len(warned) == 1 and "every 30 steps" in warned[0] and "save_freq=20" in warned[0]
  assert "costs 6.0 ms" in warned[0]


def _fit_shuffled_images(backup_dir, rows, side):
  """A fit whose shuffle buffer holds `rows` "decoded images" of side x side x 3 (a 2 KB model)."""
  images = np.random.default_rng(0).normal(size=(rows, side, side, 3)).astype("float32")
  data = tf.data.Dataset.from_tensor_slices((images, np.zeros(rows, "int32"))).shuffle(
      rows, seed=1).batch(rows // 20)
  keras.backend.clear_session()
  model = keras.Sequential([keras.Input((side, side, 3)), keras.layers.GlobalAveragePooling2D(),
                            keras.layers.Dense(2)])
  model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(data, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[
      callbacks.BackupAndRestore(str(backup_dir), save_freq=2)])


def test_a_data_position_that_dominates_the_backups_is_one_warning(tmp_path, caplog):
  # 2,000 "decoded images" of 3 KB in a shuffle buffer (4 MB left at the first backup).
  _fit_shuffled_images(tmp_path / "backup", 2000, 16)
  warned = [r.getMessage() for r in caplog.records if "the data position is" in r.getMessage()]
  assert len(warned) == 1, warned
  assert "shuffle file names or indices before decoding" in warned[0], warned[0]
  assert "docs/data.md#state-size" in warned[0]


def test_a_small_data_position_is_no_warning_however_much_of_the_backup(tmp_path, caplog):
  # 200 images of 48 B: about 7 KB of a 9 KB backup, too little to cost a save anything.
  _fit_shuffled_images(tmp_path / "backup", 200, 2)
  assert not [r for r in caplog.records if "the data position is" in r.getMessage()]
