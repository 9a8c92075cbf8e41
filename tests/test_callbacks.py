"""tfdp.callbacks.BackupAndRestore: a plain Keras script killed mid-epoch resumes bitwise exactly."""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.conftest import REPO, WORKERS
from tests.resume_run import committed_steps
from tfdp import callbacks
from tfdp import errors

SCRIPT = [sys.executable, os.path.join(WORKERS, "resume_fit.py")]


def _run(backup_dir, slow_from=None, kill_after=None, reference_dir=None):
  """resume_fit.py in `backup_dir` (then from scratch in `reference_dir`, in the same process)."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  if slow_from is not None:
    env["TFDP_TEST_SLOW_FROM"] = str(slow_from)
  args = [backup_dir, "mirrored"] + ([reference_dir] if reference_dir else [])
  proc = subprocess.Popen(SCRIPT + args, cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  if kill_after is not None:
    deadline = time.monotonic() + 120
    while kill_after not in committed_steps(backup_dir):
      assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
      assert time.monotonic() < deadline
      time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
  out = proc.communicate(timeout=300)[0].decode("utf-8", errors="replace")
  return proc.returncode, out


def _weights(backup_dir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(os.path.join(backup_dir, "ckpt-40"))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("model/", "optimizer/"))}


@pytest.mark.slow
def test_killed_mid_epoch_and_rerun_is_bitwise_equal(tmp_path):
  reference = str(tmp_path / "reference")
  backup = str(tmp_path / "backup")
  # Step 15 is inside epoch 2 (steps 8..15); the kill lands a step or two later.
  code, out = _run(backup, slow_from=15, kill_after=15)
  assert code == -signal.SIGKILL, out[-3000:]
  assert committed_steps(backup) == [15]  # max_to_keep=1, like Keras's backup
  # The rerun, in a fresh process; then, in that process, the uninterrupted
  # reference from scratch (after the rerun has written its last backup, so
  # it cannot touch it; a process of its own would start TensorFlow again).
  code, out = _run(backup, reference_dir=reference)
  resumed, uninterrupted = "restored_step=15 final_step=40", "restored_step=None final_step=40"
  assert code == 0 and resumed in out and uninterrupted in out, out[-3000:]
  assert out.index(resumed) < out.index(uninterrupted), out[-3000:]

  ref, res = _weights(reference), _weights(backup)
  assert sorted(ref) == sorted(res)
  assert any("seed_generator" in k for k in ref)
  for k in ref:
    assert ref[k].tobytes() == res[k].tobytes(), k


def test_bad_save_freq_is_refused(tmp_path):
  with pytest.raises(errors.ConfigError, match="save_freq"):
    callbacks.BackupAndRestore(str(tmp_path), save_freq="batch")
  with pytest.raises(errors.ConfigError, match="backup_dir"):
    callbacks.BackupAndRestore("")


def test_plain_model_fit_resumes_at_the_epoch_and_deletes_the_backup(tmp_path):
  # Under plain model.fit (no tfdp.fit) it behaves like Keras's callback:
  # whole epochs are skipped on resume and the backup is deleted at the end.
  backup_dir = str(tmp_path / "backup")
  x = np.random.RandomState(0).normal(size=(32, 4)).astype("float32")
  y = x.sum(axis=1, keepdims=True)

  def model_and_fit(epochs, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    cb = callbacks.BackupAndRestore(backup_dir, **kw)
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[cb])
    return model, cb, history

  model, _, _ = model_and_fit(2, delete_checkpoint=False)
  assert committed_steps(backup_dir) == [8]
  model, cb, history = model_and_fit(3)
  assert cb.restored_step == 8
  assert len(history.history["loss"]) == 1  # only epoch 3 ran
  assert int(model.optimizer.iterations.numpy()) == 12
  assert not os.path.exists(backup_dir)
