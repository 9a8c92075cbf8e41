"""tfdp on Ray Train: Ray's restarts are tfdp's resumes, from the local tier and a peer, bitwise equal to an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest

from tests import shared
from tests.conftest import REPO, WORKERS

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_restart_resumes_from_the_local_tier_and_its_peer(tmp_path):
  """One local Ray cluster: a reference run; a run whose worker 1 loses its local dir and is SIGKILLed at step 35."""
  root = str(tmp_path)
  proc = subprocess.run([sys.executable, os.path.join(WORKERS, "ray_fit.py"), root],
                        cwd=REPO, env=shared.environ(TF_CPP_MIN_LOG_LEVEL="2"),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400,
                        check=False)
  out = proc.stdout.decode("utf-8", errors="replace")
  assert proc.returncode == 0, out[-5000:]
  with open(os.path.join(root, "result.json")) as f:
    result = json.load(f)
  reference, killed = result["reference"], result["killed"]
  # One attempt each for the reference; Ray restarted the killed run's group once.
  assert [len(a) for a in reference["attempts"].values()] == [1, 1]
  assert [len(a) for a in killed["attempts"].values()] == [2, 2]
  assert killed["attempts"]["1"][0] is None  # SIGKILLed, it recorded nothing.
  for rank in ("0", "1"):
    resumed = killed["attempts"][rank][1]
    # Local interval 2, killed after step 35: step 34, worker 1's state from worker 0.
    assert (resumed["restored_step"], resumed["restored_tier"]) == (34, "peer"), resumed
  assert killed["weights"] == reference["weights"]
  # Ray's record: the newest committed backup, its step in the metrics.
  assert killed["pointer"] == {"backup_dir": os.path.join(root, "killed", "backup"),
                               "prefix": os.path.join(root, "killed", "backup", "ckpt-40"),
                               "step": 40}
  assert killed["metrics"]["step"] == 40
  # Goodput over Ray's attempts: the killed one, and the resumed one that recomputed step 35.
  with open(os.path.join(root, "killed", "backup", "goodput.json")) as f:
    attempts = json.load(f)["attempts"]
  assert [(a["failed"], a["restored_step"], a["restored_tier"], a["recomputed_steps"])
          for a in attempts] == [(True, None, None, 0), (False, 34, "peer", 1)], attempts
  # The driver reads the goodput line: the one the chief printed, over both attempts.
  line = killed["goodput"]
  assert line.startswith("goodput ") and "1 restart (" in line and "1 steps recomputed" in line
  assert f"tfdp: {line}" in killed["printed"]["0"][-1]
  # One voice: Keras's epoch lines and tfdp's line come from the chief (rank 0) alone.
  for run in (reference, killed):
    assert "Epoch 3/3" in run["printed"]["0"][-1], run["printed"]
    assert not any("Epoch" in p or "goodput" in p for p in run["printed"]["1"]), run["printed"]


def _attempt(directory, finish):
  """One attempt's goodput records in `directory`, written by a process that then ends (or dies)."""
  code = ("import sys; from tfdp import goodput; r = goodput.Recorder(sys.argv[1], tensorboard=False)\n"
          "for s in range(1, 6): r.step(s)\n" + ("r.finished(5)" if finish else ""))
  subprocess.run([sys.executable, "-c", code, directory], cwd=REPO, env=shared.environ(),
                 check=True, stdout=subprocess.DEVNULL, timeout=60)


def test_goodput_summary_of_a_finished_run_and_of_one_ray_gave_up_on(tmp_path):
  """goodput_summary reads the finished run's goodput.json, and sums a newer run that never finished."""
  from tfdp import goodput
  from tfdp.integrations import ray as tfdp_ray
  directory = str(tmp_path)
  assert tfdp_ray.goodput_summary(directory) is None
  _attempt(directory, finish=True)
  with open(os.path.join(directory, "goodput.json")) as f:
    finished = goodput.summary_line(json.load(f))
  assert tfdp_ray.goodput_summary(directory) == finished
  # A later run's two attempts, both gone unfinished (Ray's max_failures spent).
  _attempt(directory, finish=False)
  _attempt(directory, finish=False)
  line = tfdp_ray.goodput_summary(directory)
  assert line != finished and line.startswith("goodput ") and "1 restart (" in line, line
