"""TF's multi-worker custom-loop tutorial with tfdp.CheckpointManager: a directory per non-chief, killed and resumed."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests import shared
from tests.conftest import REPO, WORKERS, launch_workers

TUTORIAL = [sys.executable, os.path.join(WORKERS, "tutorial_ctl.py")]
# The tutorial as written, with absl's info lines shown (the chief's line on the directories).
VERBOSE = [sys.executable, "-c",
           "import runpy, sys; from absl import logging; logging.set_verbosity('info'); "
           f"sys.argv[0] = {TUTORIAL[1]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"]
MISMATCH = [sys.executable, os.path.join(WORKERS, "dir_mismatch.py")]


def _launch(root, log_path):
  env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2", TFDP_SHOW_TF_LOGS="1")
  with open(log_path, "wb") as log:
    return subprocess.Popen(
        [sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--"] + VERBOSE + [root],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _kill_mid_epoch(root):
  """Starts the tutorial, SIGKILLs both workers a little into its second epoch; returns the log."""
  log_path = os.path.join(root, "first.log")
  proc = _launch(root, log_path)
  first = os.path.join(root, "ckpt", "ckpt-1.manifest.json")
  try:
    deadline = time.monotonic() + 240
    while not os.path.exists(first):
      assert proc.poll() is None, open(log_path).read()[-5000:]
      assert time.monotonic() < deadline, "no checkpoint in time"
      time.sleep(0.05)
    time.sleep(1.0)  # Into epoch 1 (an epoch takes seconds).
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
      workers = [int(p) for p in f.read().split()]
    assert len(workers) == 2, workers
    for pid in workers:
      os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  with open(log_path, encoding="utf-8", errors="replace") as f:
    return f.read()


def _epochs(out, worker=0):
  tag = f"[worker {worker}] Epoch: "
  return [int(line.split(tag)[1].split(",")[0]) for line in out.splitlines() if tag in line]


@pytest.mark.slow
def test_tutorial_directories_kill_and_resume(tmp_path):
  """The tutorial as written trains into the chief's directory, resumes at its saved epoch, leaves worker 1's empty.

  Beside it (its processes mostly wait), workers whose directories the
  others do not see (ram:// is per process) all fail within seconds,
  naming both directories.
  """
  root = str(tmp_path)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    mismatch = pool.submit(launch_workers, MISMATCH + [os.path.basename(root), "0"])
    out = _kill_mid_epoch(root)
    assert _epochs(out) == [0], out[-5000:]
    ckpt = os.path.join(root, "ckpt")
    assert not os.path.exists(os.path.join(ckpt, "ckpt-2.manifest.json")), "killed too late"
    assert "were given other checkpoint directories" in out, out[-5000:]

    code, out = launch_workers(TUTORIAL + [root])
    assert code == 0, out[-5000:]
    assert _epochs(out, 0) == _epochs(out, 1) == [1, 2], out[-5000:]

    mismatch_code, mismatch_out = mismatch.result()
  saved = [f for f in os.listdir(ckpt) if f.startswith("ckpt-")]
  assert sorted(saved) == ["ckpt-3.data-00000-of-00002", "ckpt-3.data-00001-of-00002",
                           "ckpt-3.index", "ckpt-3.manifest.json"], saved
  assert tf.train.latest_checkpoint(ckpt) == os.path.join(ckpt, "ckpt-3")
  reader = tf.train.load_checkpoint(os.path.join(ckpt, "ckpt-3"))
  assert reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE") == 3
  own = os.path.join(root, "workertemp_1")
  assert os.path.isdir(own)
  assert [files for _, _, files in os.walk(own) if files] == []

  assert mismatch_code != 0
  for w in (0, 1):
    line = next(l for l in mismatch_out.splitlines() if l.startswith(f"[worker {w}] failed after"))
    assert float(line.split("failed after ")[1].split("s:")[0]) < 30, line
    assert "ram://" in line and "-w1/ckpt" in line and "-w0/ckpt" in line, line
