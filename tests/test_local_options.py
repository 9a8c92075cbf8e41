"""The manager's two tiers composed: one LocalOptions value, and one snapshot a step for the tiers due."""

import os

import pytest
import tensorflow as tf

from tfdp import callbacks
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.local.options import LocalOptions
from tfdp.checkpoint.manager import CheckpointManager


def test_the_callbacks_arguments_are_one_local_options_value(tmp_path):
  local = str(tmp_path / "local")
  backup = callbacks.BackupAndRestore(str(tmp_path / "backup"), local_checkpoint_every_steps="auto",
                                      checkpoint_overhead=0.05, local_checkpoint_dir=local)
  assert backup.local_options == LocalOptions("auto", 0.05, local)
  assert (backup.local_checkpoint_every_steps, backup.checkpoint_overhead,
          backup.local_checkpoint_dir) == ("auto", 0.05, local)
  backup.local_checkpoint_every_steps = 7  # Settable before fit, as the attributes were.
  assert backup.local_options == LocalOptions(7, 0.05, local)
  assert not LocalOptions().wanted and LocalOptions(directory=local).wanted
  assert LocalOptions(every_steps="3").checked().every_steps == 3
  with pytest.raises(ValueError, match="positive number of steps or 'auto'"):
    LocalOptions(every_steps="often").checked()


def test_a_steps_saves_to_both_tiers_take_one_snapshot(tmp_path):
  """save_at_step: the local copy of a step with a persistent save holds what that save took."""
  step = tf.Variable(0, dtype=tf.int64)
  ckpt = tf.train.Checkpoint(v=tf.Variable(tf.zeros([8])), step=step)
  manager = CheckpointManager(ckpt, str(tmp_path / "model"), local_options=LocalOptions(
      every_steps=2, directory=str(tmp_path / "local")))
  gathered, told = [], []

  class Counted(reads.CachedGather):

    def __call__(self):
      gathered.append(int(step.numpy()))
      return super().__call__()

  manager._gather = Counted(ckpt)  # pylint: disable=protected-access
  try:
    for s in range(1, 5):
      step.assign(s)
      ckpt.v.assign_add(tf.ones([8]))
      assert manager.save_at_step(s, persistent=s == 4, blocked=lambda _, tier, s=s: told.append(
          (s, tier))) == (manager.latest_checkpoint if s == 4 else None)
    manager.sync()
    assert gathered == [2, 4], gathered  # Step 4's local copy is the persistent save's snapshot.
    assert told == [(2, "local"), (4, "persistent"), (4, "local")], told
    assert [os.path.basename(p) for p in manager.local_checkpoints()] == ["ckpt-2", "ckpt-4"]
    assert os.path.basename(manager.latest_checkpoint) == "ckpt-4"
  finally:
    manager.close()
