"""Bitwise exact resume of tfdp-train: 2 real workers killed by SIGKILL, then rerun on 2 workers or on 1."""

import os

import pytest

from tests.resume_run import FINAL, assert_bitwise_equal, reference_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(resume_runs):
  return reference_of(resume_runs)["final"]


@pytest.fixture(scope="module")
def runs(resume_runs):
  """The shared runs of tests/resume_run.py: the kill and its reruns on 2 workers and on 1."""
  return resume_runs


def test_sigkill_then_rerun_is_bitwise_equal(reference, runs):
  killed = runs["killed"]
  code, out, steps = killed["code"], killed["out"], killed["steps"]
  assert code != 0, out[-3000:]
  assert "worker 1 was killed by SIGKILL" in out, out[-3000:]
  assert max(steps) >= 20 and 60 not in steps, steps
  resumed = killed["resumed"]
  assert killed["resumed_code"] == 0, resumed[-5000:]
  assert "Restored" in resumed, resumed[-5000:]
  assert f"at step {max(steps)}" in resumed
  assert_bitwise_equal(reference, os.path.join(killed["model_dir"], FINAL))


def test_two_worker_checkpoint_resumed_on_one_worker_with_two_replicas(reference, runs):
  # tfdp-train --strategy=mirrored --cpu_replicas=2 in a model_dir holding
  # only ckpt-20 of the killed 2-worker run.
  one = runs["one_worker"]
  assert one["code"] == 0, one["out"][-5000:]
  assert "at step 20" in one["out"]
  assert_bitwise_equal(reference, os.path.join(one["model_dir"], FINAL))
