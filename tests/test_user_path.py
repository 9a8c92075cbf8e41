"""The user's own code under tfdp-launch with 2 real workers: a converted Keras script killed with SIGKILL and rerun."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, WORKERS
from tests.test_resume import committed_steps

SCRIPT = os.path.join(WORKERS, "keras_converted.py")


def _children(pid):
  """Pids of the live processes whose parent is `pid`."""
  kids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[1]) == pid and fields[0] != "Z":
        kids.append(int(entry))
  return kids


def _launch(args, env=None):
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  full_env.pop("TF_CONFIG", None)
  return subprocess.Popen(
      [sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--", sys.executable, SCRIPT]
      + args, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("save_freq,delete,double", [("epoch", "1", "1"), ("5", "0", "0")])
def test_converted_script_killed_and_rerun_finishes_on_both_workers(tmp_path, save_freq,
                                                                    delete, double):
  backup = str(tmp_path / "backup")
  args = [backup, save_freq, delete, double]
  proc = _launch(args, env={"TFDP_TEST_SLOW_FROM": "40"})
  deadline = time.monotonic() + 240
  while not [s for s in committed_steps(backup) if s >= 40]:
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    assert time.monotonic() < deadline, "no checkpoint past step 40"
    time.sleep(0.1)
  workers = _children(proc.pid)
  assert len(workers) == 2, workers
  os.kill(max(workers), signal.SIGKILL)  # a worker dies as on a lost host
  out = proc.communicate(timeout=120)[0].decode("utf-8", errors="replace")
  assert proc.returncode != 0, out[-3000:]

  proc = _launch(args)
  out = proc.communicate(timeout=300)[0].decode("utf-8", errors="replace")
  assert proc.returncode == 0, out[-4000:]
  finals = re.findall(r"test_accuracy=([\d.]+) step=(\d+) restored_step=(\d+)", out)
  assert len(finals) == 2, out[-4000:]  # both workers finished and evaluated
  assert {step for _, step, _ in finals} == {"128"}  # 8 epochs of 16 steps
  assert all(float(acc) > 0.8 for acc, _, _ in finals), finals
  assert int(finals[0][2]) >= 40
  if delete == "1":
    assert not os.path.exists(backup)
  else:
    assert committed_steps(backup)[-1] == 125  # the last multiple of 5
