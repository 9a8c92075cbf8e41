"""Plain model.fit on a user's tf.data pipeline, SIGKILLed mid-epoch and rerun: bitwise equal to an uninterrupted run.

tests/workers/data_resume.py is a plain Keras script with
tfdp.callbacks.BackupAndRestore (TFRecord files, interleave, seeded shuffle,
stateless augmentation, batch, prefetch; dropout; op determinism). One
uninterrupted run per topology is shared by every assertion.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, WORKERS, launch_workers

SCRIPT = os.path.join(WORKERS, "data_resume.py")
MODES = ("finite", "repeat", "arrays", "source")


def _run(out_root, modes, env=None, replicas=2):
  """One process: Mirrored over 2 CPU replicas (1: no strategy)."""
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  full_env.pop("TF_CONFIG", None)
  proc = subprocess.run([sys.executable, SCRIPT, str(out_root), modes, str(replicas)], cwd=REPO,
                        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        timeout=300, check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


def _weights(out_root, mode, worker=0):
  return np.load(os.path.join(out_root, mode, f"weights-{worker}.npy"))


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
  root = tmp_path_factory.mktemp("mirrored")
  code, out = _run(root / "ref", ",".join(MODES))
  assert code == 0, out[-3000:]
  return root


@pytest.mark.parametrize("mode,kill_at,background", [
    ("finite", 20, "0"), ("repeat", 7, "1"), ("arrays", 26, "0"), ("source", 17, "0")])
def test_mirrored_fit_killed_mid_epoch_resumes_bitwise(mirrored, mode, kill_at, background):
  """`background`: async saves, whose data position is taken at the step of their variables."""
  cut = mirrored / f"cut-{mode}"
  env = {"TFDP_TEST_ASYNC": background}
  code, out = _run(cut, mode, env=dict(env, TFDP_TEST_KILL_AT=str(kill_at)))
  assert code == -9, out[-3000:]  # SIGKILLed after the step, not before its save
  code, out = _run(cut, mode, env=env)
  assert code == 0, out[-3000:]
  restored = int(re.search(r"restored=(\d+)", out).group(1))
  assert 0 < restored <= kill_at and restored % 3 == 0, out[-3000:]  # a mid-run backup
  np.testing.assert_array_equal(_weights(mirrored / "ref", mode), _weights(cut, mode))


def test_fit_without_a_strategy_killed_mid_epoch_resumes_bitwise(tmp_path):
  code, out = _run(tmp_path / "ref", "finite", replicas=1)
  assert code == 0, out[-3000:]
  code, out = _run(tmp_path / "cut", "finite", replicas=1, env={"TFDP_TEST_KILL_AT": "8"})
  assert code == -9, out[-3000:]
  code, out = _run(tmp_path / "cut", "finite", replicas=1)
  assert code == 0 and "restored=6" in out, out[-3000:]
  np.testing.assert_array_equal(_weights(tmp_path / "ref", "finite"),
                                _weights(tmp_path / "cut", "finite"))


def test_uninterrupted_fit_trains_on_what_stock_tf_distributes(mirrored):
  """The checkpointable iterators yield TF's own elements: same weights as with the hooks off."""
  stock = mirrored / "stock"
  code, out = _run(stock, "finite", env={"TFDP_COMPAT_DISABLE": "fit_data_state"})
  assert code == 0, out[-3000:]
  np.testing.assert_array_equal(_weights(mirrored / "ref", "finite"), _weights(stock, "finite"))


def test_backup_without_data_position_restores_with_a_warning(mirrored):
  old = mirrored / "old"
  code, out = _run(old, "repeat", env={"TFDP_COMPAT_DISABLE": "fit_data_state",
                                       "TFDP_TEST_KILL_AT": "7"})
  assert code == -9, out[-3000:]
  code, out = _run(old, "repeat")
  assert code == 0, out[-3000:]
  assert "holds no data position" in out and "restarts from its first batch" in out, out[-3000:]
  assert "RESULT mode=repeat worker=0 steps=16 restored=6" in out  # 6 restored + epoch 1 rerun + epoch 2


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
  root = tmp_path_factory.mktemp("two_workers")
  code, out = launch_workers([sys.executable, SCRIPT, str(root / "ref"), "finite,data"])
  assert code == 0, out[-3000:]
  return root


@pytest.mark.parametrize("mode,kill_at", [("finite", 8), ("data", 11)])
def test_two_worker_fit_killed_mid_epoch_resumes_bitwise(two_workers, mode, kill_at):
  """Keras auto-sharding by FILE (finite) and by DATA; worker 1 is SIGKILLed.

  By DATA, the backup also has a local tier every 2 steps (in /dev/shm):
  the kill at step 11 resumes from each worker's own copy of step 10, data
  positions included, not from the persistent step 9.
  """
  cut = two_workers / f"cut-{mode}"
  tier = {"TFDP_TEST_LOCAL_EVERY": "2", "TFDP_TEST_KILL_DELAY": "1"} if mode == "data" else {}
  code, out = launch_workers([sys.executable, SCRIPT, str(cut), mode],
                             env={"TFDP_TEST_KILL_AT": str(kill_at), "TFDP_TEST_KILL_WORKER": "1",
                                  **tier})
  assert code != 0, out[-3000:]
  if mode == "finite":  # Another topology cannot take the per-worker positions.
    manifests = sorted((cut / mode / "backup").glob("ckpt-*.manifest.json"))
    writers = json.loads(manifests[-1].read_text())["writers"]
    # Each worker wrote its own iterator state (the shuffle buffer dominates).
    assert all(writers[w]["per_worker_bytes"] > 1000 for w in ("0", "1")), writers
    moved = two_workers / "moved"
    shutil.copytree(cut / mode / "backup", moved / mode / "backup")
    code, other = _run(moved, mode)
    assert code != 0 and "holds the data positions of 2 worker(s) with 2 replica(s) in all" in other, (
        other[-3000:])
    assert "restart_epoch_data=True" in other
  code, out = launch_workers([sys.executable, SCRIPT, str(cut), mode], env=tier)
  assert code == 0, out[-3000:]
  assert len(re.findall(rf"RESULT mode={mode} worker=\d steps=\d+ restored=[1-9]", out)) == 2, (
      out[-3000:])
  if tier:  # The persistent tier's newest is step 9.
    assert len(re.findall(r"RESULT mode=data worker=\d steps=\d+ restored=10\b", out)) == 2, (
        out[-3000:])
  ref = _weights(two_workers / "ref", mode)
  for worker in (0, 1):
    np.testing.assert_array_equal(ref, _weights(cut, mode, worker))
