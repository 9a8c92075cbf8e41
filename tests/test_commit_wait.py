"""A worker waiting for a commit that can no longer come fails fast and says why."""

import shutil
import threading
import time

import pytest
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint import CheckpointManager


def test_a_deleted_directory_ends_the_wait_for_the_chiefs_commit(tmp_path):
  d = str(tmp_path / "backup")
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  chief = CheckpointManager(ckpt, d, worker_index=0, num_workers=2, run_id="job-a",
                            commit_timeout=120)
  worker = CheckpointManager(ckpt, d, worker_index=1, num_workers=2, run_id="job-a",
                             commit_timeout=120)
  # The chief has finished training and deletes the backup directory, as a
  # BackupAndRestore with delete_checkpoint=True does, while worker 1 saves.
  deleter = threading.Timer(1.0, shutil.rmtree, args=(d,))
  deleter.start()
  start = time.monotonic()
  with pytest.raises(errors.CheckpointError, match="was deleted while this worker waited"):
    worker.save(checkpoint_number=7)
  assert time.monotonic() - start < 30  # not the 240 s commit timeout
  deleter.join()
  del chief
