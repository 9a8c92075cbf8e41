"""Tests of tfdp.compat: Keras fit/evaluate/predict under real 2-worker MultiWorkerMirroredStrategy runs."""

import dataclasses
import io
import os
import sys

from absl import logging
import numpy as np
import pytest
import tensorflow as tf
import keras

from tfdp import compat
from tfdp import errors
from tfdp import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "compat_worker.py")

# For each fix: the worker part that needs it and what goes wrong without it
# (an error in the output, or None when the workers end with different weights).
PROBES = {
    "symbolic_build_batch": (
        "probe_fit", "Attempt to convert a value (PerReplica"),
    "reduce_mean_axis": (
        "probe_fit", "Invalid reduction dimension 0 for input with 0 dimensions"),
    "steps_per_execution_inline": (
        "probe_spe", "You must feed a value for placeholder tensor"),
    "non_trainable_mean_aggregation": ("probe_bn", None),
}


def _run_workers(out_dir, parts, disable=None):
  """Runs the worker on 2 local workers; returns (exit code, output, results)."""
  env = dict(os.environ)
  env.pop(compat.DISABLE_ENV, None)
  if disable:
    env[compat.DISABLE_ENV] = disable
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  buf = io.StringIO()
  rc = launch.launch([sys.executable, WORKER, str(out_dir), parts],
                     num_workers=2, env=env, out=buf, grace_seconds=5)
  output = buf.getvalue()
  results = [
      dict(np.load(os.path.join(out_dir, f"worker{i}.npz")))
      for i in range(2) if os.path.exists(os.path.join(out_dir, f"worker{i}.npz"))
  ]
  return rc, output, results


def _assert_same(a, b, prefix):
  keys = sorted(k for k in a if k.startswith(prefix))
  assert keys, prefix
  for k in keys:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """One 2-worker run with every fix on: the seq and multi parts."""
  out_dir = tmp_path_factory.mktemp("compat_full")
  rc, output, results = _run_workers(out_dir, "seq,multi")
  assert rc == 0, output[-5000:]
  assert len(results) == 2, output[-5000:]
  return results


@pytest.mark.slow
def test_fit_identical_on_workers_and_equal_to_one_replica(full_run):
  w0, w1 = full_run
  _assert_same(w0, w1, "seq_w")
  _assert_same(w0, w1, "seq_loss")
  # 2 replicas x 8 rows with averaged gradients == 1 replica x 16 rows.
  for i in range(4):
    np.testing.assert_allclose(w0[f"seq_w{i}"], w0[f"seq_ref_w{i}"],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_evaluate_identical_on_workers_and_global(full_run):
  w0, w1 = full_run
  np.testing.assert_array_equal(w0["seq_eval"], w1["seq_eval"])
  # The metrics cover all 70 rows of both workers, not one worker's share.
  np.testing.assert_allclose(w0["seq_eval"], w0["seq_ref_eval"], rtol=1e-5)


@pytest.mark.slow
def test_predict_returns_every_row_in_order(full_run):
  for w in full_run:
    assert w["seq_pred"].shape == (70, 1)
    np.testing.assert_allclose(w["seq_pred"], w["seq_direct"], atol=1e-5)
  np.testing.assert_array_equal(full_run[0]["seq_pred"],
                                full_run[1]["seq_pred"])


@pytest.mark.slow
def test_dict_inputs_two_outputs_batch_norm_steps_per_execution(full_run):
  w0, w1 = full_run
  _assert_same(w0, w1, "multi_w")
  _assert_same(w0, w1, "multi_bn_")
  _assert_same(w0, w1, "multi_eval_")
  _assert_same(w0, w1, "multi_loss")
  assert np.isfinite(w0["multi_loss"]).all()
  assert (w0["multi_bn_moving_mean"] != 0).any()  # the statistics moved
  for w in full_run:
    for k, width in (("y", 1), ("z", 2)):
      assert w[f"multi_pred_{k}"].shape == (70, width)
      np.testing.assert_allclose(w[f"multi_pred_{k}"], w[f"multi_direct_{k}"],
                                 atol=1e-5)


# Fixes whose need another test shows (the behaviour without them).
TESTED_ELSEWHERE = {
    "fit_data_state":
        "tests/test_fit_data_position.py::test_backup_without_data_position_restores_with_a_warning",
    "chief_only_verbose": "test_progress_bars_only_on_the_chief_unless_asked",
}


def test_every_fix_has_a_probe():
  assert set(PROBES) | set(TESTED_ELSEWHERE) == set(compat.fixes())


@pytest.mark.slow
def test_progress_bars_only_on_the_chief_unless_asked(run_workers):
  code, out = run_workers([sys.executable, os.path.join(os.path.dirname(WORKER),
                                                        "verbose_worker.py")])
  assert code == 0 and "DONE 0" in out and "DONE 1" in out, out[-3000:]
  lines = out.split("\n")  # A progress bar redraws with \r within one line.
  bars = {w: [l for l in lines if l.startswith(f"[worker {w}]") and "step" in l] for w in (0, 1)}
  # Chief: fit's, evaluate's and predict's bars plus the verbose=2 line; worker 1: that line only.
  assert len([l for l in bars[0] if "\u2501" in l]) == 3 and len(bars[0]) == 4, out[-3000:]
  assert len(bars[1]) == 1 and "loss" in bars[1][0], bars[1]


@pytest.mark.slow
@pytest.mark.parametrize("fix", sorted(PROBES))
def test_fix_is_needed(fix, tmp_path):
  part, error = PROBES[fix]
  rc, output, results = _run_workers(tmp_path, part, disable=fix)
  assert f"'{fix}'" not in output.split("compat fixes applied:", 1)[-1].split(
      "\n", 1)[0]
  if error is not None:
    assert rc != 0
    assert error in output, output[-5000:]
  else:
    assert rc == 0, output[-5000:]
    w0, w1 = results
    keys = sorted(k for k in w0 if k.startswith("probe_w"))
    assert any(not np.array_equal(w0[k], w1[k]) for k in keys)


def _mirrored_fit(batch_norm=False):
  devices = tf.config.list_logical_devices("CPU")
  assert len(devices) >= 2, "conftest should split the CPU in 2"
  # ReductionToOneDevice, as tfdp.make_strategy picks for CPU replicas: TF's
  # default collective ops clash when several strategies share one process.
  strategy = tf.distribute.MirroredStrategy(
      [d.name for d in devices[:2]],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, size=(38, 4)).astype("float32")
  y = x.sum(axis=1, keepdims=True)
  keras.utils.set_random_seed(3)
  with strategy.scope():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4)]
        + ([keras.layers.BatchNormalization()] if batch_norm else [])
        + [keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
  history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  return (history.history, model.evaluate(x, y, batch_size=16, verbose=0),
          model.predict(x, batch_size=16, verbose=0), model.get_weights(),
          [[c.numpy() for c in v.value.values] for v in model.non_trainable_weights])


@pytest.mark.slow
def test_mirrored_batch_norm_statistics_agree_on_every_replica():
  # Upstream: each device keeps its own moving statistics (a checkpoint holds
  # device 0's); with the fix every replica holds their mean.
  patched = _mirrored_fit(batch_norm=True)
  compat.revert()
  try:
    upstream = _mirrored_fit(batch_norm=True)
  finally:
    compat.apply()
  assert len(patched[4]) == 2  # moving mean and variance
  for copies in patched[4]:
    np.testing.assert_array_equal(copies[0], copies[1])
  assert any(not np.array_equal(copies[0], copies[1]) for copies in upstream[4])


def test_mirrored_strategy_behaves_as_upstream():
  assert compat.applied() == set(compat.fixes())
  patched = _mirrored_fit()
  compat.revert()
  try:
    upstream = _mirrored_fit()
  finally:
    compat.apply()
  assert patched[0] == upstream[0]
  assert patched[1] == upstream[1]
  np.testing.assert_array_equal(patched[2], upstream[2])
  assert patched[2].shape == (38, 1)
  for a, b in zip(patched[3], upstream[3]):
    np.testing.assert_array_equal(a, b)
  assert patched[4] == []  # no BatchNormalization: the aggregation fix has nothing to do


def test_apply_is_idempotent():
  before = {
      "fn": keras.src.backend.tensorflow.trainer.reduce_per_replica,
      "method": keras.src.backend.tensorflow.trainer.TensorFlowTrainer
                .__dict__["_make_function"],
  }
  assert compat.apply() == compat.apply() == set(compat.fixes())
  assert keras.src.backend.tensorflow.trainer.reduce_per_replica is before["fn"]
  assert (keras.src.backend.tensorflow.trainer.TensorFlowTrainer
          .__dict__["_make_function"] is before["method"])


def test_revert_restores_upstream():
  trainer = keras.src.backend.tensorflow.trainer
  patched = trainer.reduce_per_replica
  compat.revert()
  try:
    assert not compat.applied()
    assert trainer.reduce_per_replica is patched.__wrapped__
    assert not hasattr(trainer.reduce_per_replica, "__tfdp_compat_fix__")
  finally:
    compat.apply()
  assert trainer.reduce_per_replica.__wrapped__ is patched.__wrapped__
  assert trainer.reduce_per_replica.__tfdp_compat_fix__ == "reduce_mean_axis"


@pytest.mark.parametrize("value,expected", [
    ("", set()),
    ("all", "ALL"),
    (" reduce_mean_axis , symbolic_build_batch", {"reduce_mean_axis",
                                                  "symbolic_build_batch"}),
])
def test_disable_env(monkeypatch, value, expected):
  monkeypatch.setenv(compat.DISABLE_ENV, value)
  if expected == "ALL":
    expected = set(compat.fixes())
  assert compat.disabled_fixes() == expected


def test_disable_env_unknown_fix(monkeypatch):
  monkeypatch.setenv(compat.DISABLE_ENV, "reduce_mean_axis,no_such_fix")
  with pytest.raises(errors.ConfigError, match="no_such_fix"):
    compat.disabled_fixes()


def test_disabled_fix_is_not_installed(monkeypatch):
  monkeypatch.setenv(compat.DISABLE_ENV, "reduce_mean_axis")
  compat.revert()
  try:
    assert compat.apply() == set(compat.fixes()) - {"reduce_mean_axis"}
  finally:
    monkeypatch.delenv(compat.DISABLE_ENV)
    compat.revert()
    compat.apply()


def test_untested_versions_apply_only_fixes_that_still_fit(monkeypatch):
  warnings = []
  monkeypatch.setattr(logging, "warning",
                      lambda msg, *args: warnings.append(msg % args))
  monkeypatch.setattr(compat, "TESTED_KERAS", "0.0.")
  monkeypatch.setattr(compat, "_warned_versions", False)
  changed = dataclasses.replace(compat.fixes()["reduce_mean_axis"],
                                looks_as_expected=lambda: False)
  monkeypatch.setitem(compat._REGISTRY, "reduce_mean_axis", changed)  # pylint: disable=protected-access
  compat.revert()
  try:
    assert compat.apply() == set(compat.fixes()) - {"reduce_mean_axis"}
    compat.revert()
    compat.apply()
  finally:
    compat.revert()
    monkeypatch.undo()
    compat.apply()
  assert sum("tested on Keras" in w for w in warnings) == 1
  assert sum("skipping reduce_mean_axis" in w for w in warnings) == 2
  assert compat.applied() == set(compat.fixes())


def test_fixes_document_upstream_and_fit_installed_versions():
  for name, fix in compat.fixes().items():
    assert fix.doc.startswith("keras/src/"), name
    assert fix.looks_as_expected(), name
