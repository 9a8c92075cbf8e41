"""Plain model.fit on a user's tf.data pipeline, SIGKILLed mid-epoch and rerun: equal to an uninterrupted run.

Bitwise for 2 workers and for no strategy; up to round-off (1e-5) for
MirroredStrategy over 2 CPU replicas in one process (_assert_same_training).

tests/workers/data_resume.py is a plain Keras script with
tfdp.callbacks.BackupAndRestore (TFRecord files, interleave, seeded shuffle,
stateless augmentation, batch, prefetch; dropout; op determinism). Per
topology, one process (or job) trains every mode uninterrupted, one trains
them as a chain and is SIGKILLed (each mode stops at its own kill step and
trains the next there, inside its callback, so one kill leaves every mode
mid-run), and one reruns them, as a user reruns a script. Independent
processes run two at a time.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, WORKERS, launch_workers, run_all
from tests import shared
from tests.shared import shared_run

SCRIPT = os.path.join(WORKERS, "data_resume.py")

pytestmark = pytest.mark.slow


def _run(out_root, modes, env=None):
  """One process: Mirrored over 2 CPU replicas (mode `plain`: no strategy)."""
  full_env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  full_env.pop("TF_CONFIG", None)
  proc = subprocess.run([sys.executable, SCRIPT, str(out_root), modes, "2"], cwd=REPO,
                        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        timeout=300, check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


def _per_mode(setting, values):
  """{mode: value} as data_resume.py's per-mode settings: {SETTING_MODE: str(value)}."""
  return {f"{setting}_{mode.upper()}": str(value) for mode, value in values.items()}


def _weights(out_root, mode, worker=0):
  return np.load(os.path.join(out_root, mode, f"weights-{worker}.npy"))


def _assert_same_training(a, b):
  """Two processes of MirroredStrategy over 2 CPU replicas trained the same: equal up to round-off.

  Bitwise in every run here, but not in two of ~30 suite runs: one CI run
  (stop 35) saw 3.2e-7 between an uninterrupted run and a killed-and-resumed
  one, and a fresh-clone run 3.3e-7 between two uninterrupted ones (no
  restore involved). Both had two replicas in one process, whose kernels
  run concurrently (TF: "oneDNN custom operations are on. You may see
  slightly different numerical results"); the one-replica and one-replica-
  per-worker comparisons of this file stay bitwise. A wrong data position,
  RNG or optimizer state moves every weight by more than 1e-5 (another
  shuffle order: median 3.5e-3, max 1.3e-2).
  """
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


# mode -> (kill at global step, async saves): `background` saves, whose data
# position is taken at the step of their variables. In this order in one
# process (tests/workers/data_resume.py): `plain` (`finite` without a
# strategy) first; `repeat` last, so that the kill lands on its background save.
CUTS = {"plain": (8, "0"), "finite": (20, "0"), "arrays": (26, "0"), "source": (17, "0"),
        "repeat": (7, "1")}
CHAIN = ",".join(CUTS)
COMPAT_OFF = {"TFDP_COMPAT_DISABLE": "fit_data_state"}


@shared_run("mirrored_runs")
def mirrored_runs(root):
  """Every single-process run of this file, two processes at a time: {name: [code, output], "root"}.

  Under root: ref/MODE (uninterrupted, every mode of CUTS in one process);
  cut/MODE (one process trains the modes of CUTS in a chain: each stops at
  its kill step and trains the next there, inside its callback, and the last
  is SIGKILLed; then one process resumes them all, as a user reruns a
  script); stock/finite and stock/repeat (the fit_data_state fix off: an
  uninterrupted finite run, then repeat killed at 7, resumed with the fix on).
  """
  cut = _per_mode("TFDP_TEST_ASYNC", {m: a for m, (_, a) in CUTS.items()})
  kills = _per_mode("TFDP_TEST_KILL_AT", {m: k for m, (k, _) in CUTS.items()})
  first = {"ref": lambda: _run(root / "ref", CHAIN),
           "stock": lambda: _run(root / "stock", "finite,repeat",
                                 env=dict(COMPAT_OFF, TFDP_TEST_KILL_AT_REPEAT="7")),
           "killed": lambda: _run(root / "cut", CHAIN, env=dict(cut, TFDP_TEST_CHAIN="1", **kills))}
  then = {"resumed": lambda: _run(root / "cut", CHAIN, env=cut),
          "stock-resumed": lambda: _run(root / "stock", "repeat")}
  done = dict(zip(first, run_all(list(first.values()))))
  done.update(zip(then, run_all(list(then.values()))))
  done["root"] = str(root)
  return done


@pytest.fixture(scope="module")
def mirrored(mirrored_runs):
  """(root folder, runs) of `mirrored_runs`."""
  return pathlib.Path(mirrored_runs["root"]), mirrored_runs


def _restored(out, mode):
  """The step `mode` restored in a resumed run's output."""
  found = re.search(rf"RESULT mode={mode} worker=0 steps=\d+ restored=(\d+)", out)
  assert found, out[-3000:]
  return int(found.group(1))


def test_one_kill_leaves_every_mode_at_its_own_step(mirrored):
  _, runs = mirrored
  code, out = runs["killed"]
  assert code == -9, out[-3000:]  # SIGKILLed after the step, not before its save
  stops = re.findall(r"CHAIN mode=(\w+) stopped at step (\d+)", out)
  assert stops == [(m, str(k)) for m, (k, _) in list(CUTS.items())[:-1]], out[-3000:]
  assert "RESULT" not in out, out[-3000:]


@pytest.mark.parametrize("mode", sorted(set(CUTS) - {"plain"}))
def test_mirrored_fit_killed_mid_epoch_resumes_exactly(mirrored, mode):
  root, runs = mirrored
  kill_at = CUTS[mode][0]
  code, out = runs["resumed"]
  assert code == 0, out[-3000:]
  restored = _restored(out, mode)
  assert 0 < restored <= kill_at and restored % 3 == 0, out[-3000:]  # a mid-run backup
  _assert_same_training(_weights(root / "ref", mode), _weights(root / "cut", mode))


def test_fit_without_a_strategy_killed_mid_epoch_resumes_bitwise(mirrored):
  root, runs = mirrored
  code, out = runs["ref"]
  assert code == 0, out[-3000:]
  code, out = runs["resumed"]
  assert code == 0 and _restored(out, "plain") == 6, out[-3000:]
  np.testing.assert_array_equal(_weights(root / "ref", "plain"), _weights(root / "cut", "plain"))


def test_uninterrupted_fit_trains_on_what_stock_tf_distributes(mirrored):
  """The checkpointable iterators yield TF's own elements: same weights as with the hooks off."""
  root, runs = mirrored
  code, out = runs["stock"]
  assert "RESULT mode=finite worker=0" in out, out[-3000:]  # finite ran to its end first
  _assert_same_training(_weights(root / "ref", "finite"), _weights(root / "stock", "finite"))


def test_backup_without_data_position_restores_with_a_warning(mirrored):
  _, runs = mirrored
  code, out = runs["stock"]
  assert code == -9, out[-3000:]
  code, out = runs["stock-resumed"]
  assert code == 0, out[-3000:]
  assert "holds no data position" in out and "restarts from its first batch" in out, out[-3000:]
  # 6 restored + epoch 1 rerun + epoch 2
  assert "RESULT mode=repeat worker=0 steps=16 restored=6" in out


# mode -> kill at global step, in this order in one job (a chain, as above;
# worker 1 is SIGKILLed). By DATA, the backup also has a local tier every 2
# steps (in /dev/shm), and the kill waits a second for its background save.
TWO_WORKER_CUTS = {"finite": 8, "data": 11}
TWO_WORKER_MODES = ",".join(TWO_WORKER_CUTS)
TWO_WORKER_ENV = {"TFDP_TEST_LOCAL_EVERY_DATA": "2"}


@shared_run("two_worker_reference_runs")
def two_worker_reference_runs(root):
  """The uninterrupted 2-worker job, both modes in one: {"root", "ref": [code, output]}."""
  return {"root": str(root),
          "ref": launch_workers([sys.executable, SCRIPT, str(root / "ref"), TWO_WORKER_MODES])}


@pytest.fixture(scope="module")
def two_workers(two_worker_reference_runs, tmp_path_factory):
  """Every 2-worker run of this file: {name: (code, output)} and the root.

  "ref" and "ref_root": the shared uninterrupted job (two_worker_reference_runs);
  "killed": one job trains the modes of TWO_WORKER_CUTS into cut/ as a chain
  (finite stops at its step and trains data there; worker 1 is SIGKILLed in
  data); "manifest-finite": the newest manifest of cut/finite at the kill;
  then at once "moved" (the killed finite backup on 1 worker) and "resumed"
  (the same job again). A replaced host (worker 1's local tier deleted as
  it is SIGKILLed) is tests/tier_runs.py's, 5 times in one job.
  """
  root = tmp_path_factory.mktemp("two_workers")
  kills = _per_mode("TFDP_TEST_KILL_AT", TWO_WORKER_CUTS)
  runs = {"ref": two_worker_reference_runs["ref"],
          "ref_root": pathlib.Path(two_worker_reference_runs["root"])}
  runs["killed"] = launch_workers(
      [sys.executable, SCRIPT, str(root / "cut"), TWO_WORKER_MODES],
      env=dict(TWO_WORKER_ENV, TFDP_TEST_CHAIN="1", TFDP_TEST_KILL_WORKER="1",
               TFDP_TEST_KILL_DELAY_DATA="1", **kills))
  # The resumed run deletes its backups at the end, as Keras's does.
  manifests = sorted((root / "cut" / "finite" / "backup").glob("ckpt-*.manifest.json"))
  runs["manifest-finite"] = json.loads(manifests[-1].read_text()) if manifests else None
  shutil.copytree(root / "cut" / "finite" / "backup", root / "moved" / "finite" / "backup")
  runs["moved"], runs["resumed"] = run_all([
      lambda: _run(root / "moved", "finite"),
      lambda: launch_workers([sys.executable, SCRIPT, str(root / "cut"), TWO_WORKER_MODES],
                             env=TWO_WORKER_ENV)])
  return root, runs


@pytest.mark.parametrize("mode", sorted(TWO_WORKER_CUTS))
def test_two_worker_fit_killed_mid_epoch_resumes_bitwise(two_workers, mode):
  """Keras auto-sharding by FILE (finite) and by DATA; worker 1 is SIGKILLed.

  By DATA, the backup also has a local tier every 2 steps (in /dev/shm):
  the kill at step 11 resumes from each worker's own copy of step 10, data
  positions included, not from the persistent step 9.
  """
  root, runs = two_workers
  code, out = runs["ref"]
  assert code == 0, out[-3000:]
  cut = root / "cut"
  code, out = runs["killed"]
  assert code != 0, out[-3000:]
  assert "CHAIN mode=finite stopped at step 8" in out and "RESULT" not in out, out[-3000:]
  if mode == "finite":  # Another topology cannot take the per-worker positions.
    manifest = runs["manifest-finite"]  # the newest at the kill
    assert manifest, "no committed backup at the kill"
    writers = manifest["writers"]
    # Each worker wrote its own iterator state (the shuffle buffer dominates).
    assert all(writers[w]["per_worker_bytes"] > 1000 for w in ("0", "1")), writers
    code, other = runs["moved"]
    assert code != 0, other[-3000:]
    assert "holds the data positions of 2 worker(s) with 2 replica(s) in all" in other, (
        other[-3000:])
    assert "restart_epoch_data=True" in other
  code, out = runs["resumed"]
  assert code == 0, out[-3000:]
  assert len(re.findall(rf"RESULT mode={mode} worker=\d steps=\d+ restored=[1-9]", out)) == 2, (
      out[-3000:])
  if mode == "data":  # The persistent tier's newest is step 9.
    assert len(re.findall(r"RESULT mode=data worker=\d steps=\d+ restored=10\b", out)) == 2, (
        out[-3000:])
  ref = _weights(runs["ref_root"] / "ref", mode)
  for worker in (0, 1):
    np.testing.assert_array_equal(ref, _weights(cut, mode, worker))
