"""Data position across processes: the next batches after a restore are the same, per worker."""

import os
import sys

import numpy as np

from tests.conftest import WORKERS, launch_workers

SCRIPT = [sys.executable, os.path.join(WORKERS, "resume_batches.py")]


def test_next_batches_after_restore_in_a_new_process_are_identical_per_worker(tmp_path):
  out = str(tmp_path)
  # 96 examples / 8 per step = 12 steps an epoch: K=10 leaves the next
  # batches straddling an epoch boundary (a new permutation).
  k, m = 10, 4
  code, log = launch_workers(SCRIPT + [out, "first", str(k), str(m)], num_workers=2)
  assert code == 0, log[-5000:]
  code, log = launch_workers(SCRIPT + [out, "second", str(k), str(m)], num_workers=2)
  assert code == 0, log[-5000:]
  for w in (0, 1):
    first = np.load(os.path.join(out, f"first_w{w}.npz"))
    second = np.load(os.path.join(out, f"second_w{w}.npz"))
    assert int(second["start"]) == k
    assert first["images"].shape == (m, 1, 4, 4, 4, 1)  # steps, local replicas, batch
    np.testing.assert_array_equal(first["images"], second["images"])
    np.testing.assert_array_equal(first["labels"], second["labels"])
  w0, w1 = (np.load(os.path.join(out, f"second_w{w}.npz")) for w in (0, 1))
  assert not np.array_equal(w0["images"], w1["images"])  # each worker its own slice
