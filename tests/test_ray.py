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
