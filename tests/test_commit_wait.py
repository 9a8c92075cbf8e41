"""A worker waiting for a commit that can no longer come fails fast and says why."""

import os
import shutil
import threading
import time

import pytest
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint.persistent import writer as storage


def _two_workers(tmp_path):
  """(directory, chief's manager, worker 1's manager) of one 2-worker job, in this process."""
  d = str(tmp_path / "backup")
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  return d, *(CheckpointManager(ckpt, d, worker_index=w, num_workers=2, run_id="job-a",
                                commit_timeout=120) for w in (0, 1))


def test_a_deleted_directory_ends_the_wait_for_the_chiefs_commit(tmp_path):
  d, chief, worker = _two_workers(tmp_path)
  # The chief has finished training and deletes the backup directory, as a
  # BackupAndRestore with delete_checkpoint=True does, while worker 1 saves.
  deleter = threading.Timer(1.0, shutil.rmtree, args=(d,))
  deleter.start()
  start = time.monotonic()
  # By the directory's absence, or (when the deletion raced this worker's
  # shard writes, which made the directory again) by its lease's.
  with pytest.raises(errors.CheckpointError,
                     match="was deleted while this worker waited|"
                     "while this worker waited .* was deleted"):
    worker.save(checkpoint_number=7)
  assert time.monotonic() - start < storage.LEASE_GONE_S + 10  # not the 240 s commit timeout
  deleter.join()
  del chief


def _delete_and_write_again(d):
  shutil.rmtree(d)
  os.makedirs(os.path.join(d, "written-again"))


def test_a_directory_deleted_under_a_workers_writes_ends_the_wait_by_its_lease(
    tmp_path, monkeypatch):
  """The deletion raced worker 1's shard writes, which made the directory again, without a lease.

  Seen in a CI run (stop 35): the worker waited out twice commit_timeout.
  """
  monkeypatch.setattr(storage, "LEASE_GONE_S", 1.0)
  d, chief, worker = _two_workers(tmp_path)
  deleter = threading.Timer(1.0, _delete_and_write_again, args=(d,))
  deleter.start()
  start = time.monotonic()
  with pytest.raises(errors.CheckpointError, match=r"the lease of .* has not named this job "
                     r"\(session .*\) for 1s while this worker waited .* was deleted"):
    worker.save(checkpoint_number=7)
  assert time.monotonic() - start < 15
  deleter.join()
  del chief


def test_a_chief_that_released_the_lease_and_saves_again_still_commits(tmp_path, monkeypatch):
  """The lease is absent between the chief's close() and its next save: within LEASE_GONE_S that is no loss."""
  monkeypatch.setattr(storage, "LEASE_GONE_S", 5.0)
  d, chief, worker = _two_workers(tmp_path)
  chief.close()  # Releases the lease; a save after close() takes it again.
  late = threading.Timer(2.0, chief.save, kwargs={"checkpoint_number": 7})
  late.start()
  assert worker.save(checkpoint_number=7).endswith("ckpt-7")
  late.join()
  assert chief.latest_checkpoint.endswith("ckpt-7")
