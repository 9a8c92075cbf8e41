"""Tests of tfdp.compat: Keras fit/evaluate/predict under real 2-worker MultiWorkerMirroredStrategy runs and in-process mirrored strategies."""

import dataclasses
import io
import itertools
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
from tfdp.distribute import strategy as tfdp_strategy
from tfdp.compat import strategy_fixes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "compat_worker.py")

# For each fix: the worker part that needs it and what goes wrong without it
# (an error, or None when the workers end with different weights). The
# worker runs them in this order: probe_spe's error, raised inside a step
# function, may leave the collectives unusable, so it comes last.
PROBES = {
    "non_trainable_mean_aggregation": ("probe_bn", None),
    "symbolic_build_batch": (
        "probe_fit", "Attempt to convert a value (PerReplica"),
    "reduce_mean_axis": (
        "probe_fit", "Invalid reduction dimension 0 for input with 0 dimensions"),
    "steps_per_execution_inline": (
        "probe_spe", "You must feed a value for placeholder tensor"),
}


def _run_workers(out_dir, parts):
  """Runs the worker on 2 local workers; returns (exit code, output, results)."""
  env = dict(os.environ)
  env.pop(compat.DISABLE_ENV, None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  buf = io.StringIO()
  rc = launch.launch([sys.executable, WORKER, str(out_dir), ",".join(parts)],
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
def worker_run(tmp_path_factory):
  """The one 2-worker launch of this file: every part, fixes on, then each probe with its fix off.

  Returns:
    (output, [worker 0's results, worker 1's]).
  """
  out_dir = tmp_path_factory.mktemp("compat")
  parts = ["seq", "multi"] + [f"{part}:{fix}" for fix, (part, _) in PROBES.items()]
  rc, output, results = _run_workers(out_dir, parts)
  assert rc == 0, output[-5000:]
  assert len(results) == 2, output[-5000:]
  return output, results


@pytest.fixture(scope="module")
def full_run(worker_run):
  return worker_run[1]


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
    "chief_only_files": "tests/test_keras_run.py::test_every_file_has_one_writer_the_chief",
    "concat_gather_dtypes": "tests/test_mixed_bf16.py::test_bfloat16_predict_and_evaluate_on_2_workers",
    "gradient_path": "tests/test_gradient_path.py (side by side with the fix disabled and with one device)",
    "collective_deadline":
        "tests/test_gradient_path.py::test_a_stuck_collective_fails_the_worker_with_one_line",
}


def test_every_fix_has_a_probe():
  assert set(PROBES) | set(TESTED_ELSEWHERE) == set(compat.fixes())


def _section(output, worker, name):
  """The lines worker `worker` printed between "BEGIN name" and "END name"."""
  lines = [l[len(f"[worker {worker}] "):] for l in output.split("\n")
           if l.startswith(f"[worker {worker}] ")]
  return lines[lines.index(f"BEGIN {name}") + 1:lines.index(f"END {name}")]


@pytest.mark.slow
def test_progress_bars_only_on_the_chief_unless_asked(worker_run):
  out = worker_run[0]
  # A progress bar redraws with \r within one line.
  bars = {w: [l for l in _section(out, w, "verbose") if "step" in l] for w in (0, 1)}
  # Chief: fit's, evaluate's and predict's bars plus the verbose=2 line; worker 1:
  # nothing, an explicit verbose=2 included (TFDP_PROGRESS_ALL_WORKERS=1 asks
  # for every worker's: test_fit_hooks.py).
  assert len([l for l in bars[0] if "\u2501" in l]) == 3 and len(bars[0]) == 4, out[-3000:]
  assert bars[1] == [], bars[1]


@pytest.mark.slow
@pytest.mark.parametrize("fix", sorted(PROBES))
def test_fix_is_needed(fix, full_run):
  error = PROBES[fix][1]
  for w in full_run:
    assert fix not in set(w[f"applied_{fix}"])
    assert set(w[f"applied_{fix}"]) == set(compat.fixes()) - {fix}
  if error is not None:
    for w in full_run:
      assert error in str(w.get(f"error_{fix}", "no error")), w.get(f"error_{fix}")
  else:
    w0, w1 = full_run
    assert f"error_{fix}" not in w0 and f"error_{fix}" not in w1, w0.get(f"error_{fix}")
    keys = sorted(k for k in w0 if k.startswith(f"{fix}_w"))
    assert keys
    assert any(not np.array_equal(w0[k], w1[k]) for k in keys)


def _mirrored_fit(batch_norm=False, evaluate_and_predict=True):
  """fit (then evaluate and predict) under a MirroredStrategy over 2 CPUs.

  Returns:
    (history, evaluate's result, predict's, weights, each non-trainable
    weight's per-replica copies); evaluate's and predict's are None when
    not `evaluate_and_predict`.
  """
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
  evaluated = predicted = None
  if evaluate_and_predict:  # each traces a function of its own
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
    predicted = model.predict(x, batch_size=16, verbose=0)
  return (history.history, evaluated, predicted, model.get_weights(),
          [[c.numpy() for c in v.value.values] for v in model.non_trainable_weights])


@pytest.mark.slow
def test_mirrored_batch_norm_statistics_agree_on_every_replica():
  # Upstream: each device keeps its own moving statistics (a checkpoint holds
  # device 0's); with the fix every replica holds their mean. Only fit moves
  # the statistics: no evaluate or predict (test_mirrored_strategy_behaves_as_upstream
  # runs those).
  patched = _mirrored_fit(batch_norm=True, evaluate_and_predict=False)
  compat.revert()
  try:
    upstream = _mirrored_fit(batch_norm=True, evaluate_and_predict=False)
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


# Strategies over this process's 2 logical CPUs, and whether their step
# launches collective ops whose instance key is fed at call time (so
# upstream's steps_per_execution > 1 loop fails under them).
_CPUS = ("/cpu:0", "/cpu:1")
SPE_STRATEGIES = {
    "mirrored_default": (lambda: tf.distribute.MirroredStrategy(_CPUS), True),
    "tfdp_mirrored_ring": (
        lambda: tfdp_strategy.make_strategy("mirrored", cpu_replicas=2, all_reduce="ring"), True),
    "multi_worker_one_worker_two_replicas": (
        lambda: tfdp_strategy._MultiWorkerCpuReplicasStrategy(  # pylint: disable=protected-access
            2, tfdp_strategy.communication_options("ring")), True),
    "mirrored_one_device": (lambda: tf.distribute.MirroredStrategy(_CPUS[:1]), False),
    # tfdp.make_strategy's choice between CPU replicas: ReductionToOneDevice.
    "tfdp_mirrored": (lambda: tfdp_strategy.make_strategy("mirrored", cpu_replicas=2), False),
    "default": (tf.distribute.get_strategy, False),
}
_key_bases = itertools.count(200_000, 10_000)


def _spe_fit(strategy, steps_per_execution):
  """fit (4 steps: one execution of 3, one of 1) and evaluate; returns (weights, loss)."""
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, size=(64, 4)).astype("float32")
  y = x.sum(axis=1, keepdims=True)
  keras.utils.set_random_seed(4)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=steps_per_execution)
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  return model.get_weights(), model.evaluate(x, y, batch_size=16, verbose=0)


@pytest.mark.parametrize("name", sorted(SPE_STRATEGIES))
def test_steps_per_execution_inline_serves_every_strategy_whose_step_fails_upstream(
    name, monkeypatch):
  """The fix acts where the strategy's step defers collective keys, whatever the strategy's class.

  Under a MirroredStrategy over 2 CPUs (the user's own, default cross-device
  ops) and steps_per_execution=3, upstream's first step fails; with the fix
  the run equals steps_per_execution=1 on the same strategy. Where the step
  launches no such collectives, upstream runs and the fix leaves it alone.
  """
  # Each strategy its own collective keys: TF caches collective instances by
  # key, and strategies of one process would otherwise share them.
  base = next(_key_bases)
  monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", base)
  monkeypatch.setattr(tf.distribute.MultiWorkerMirroredStrategy, "_collective_key_base", base)
  make, defers = SPE_STRATEGIES[name]
  strategy = make()
  assert strategy_fixes.defers_collective_keys(strategy) == defers
  fixed = _spe_fit(strategy, 3)
  if defers:  # The inline loop runs the same steps as one step per execution.
    one_step = _spe_fit(strategy, 1)
    for a, b in zip(one_step[0], fixed[0]):
      np.testing.assert_array_equal(a, b)
    assert one_step[1] == fixed[1]
  # Upstream last: its failure inside a step may leave the collectives unusable.
  monkeypatch.setenv(compat.DISABLE_ENV, "steps_per_execution_inline")
  compat.revert()
  try:
    assert "steps_per_execution_inline" not in compat.apply()
    if defers:
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="You must feed a value for placeholder tensor"):
        _spe_fit(strategy, 3)
    else:
      upstream = _spe_fit(strategy, 3)
      for a, b in zip(upstream[0], fixed[0]):
        np.testing.assert_array_equal(a, b)
      assert upstream[1] == fixed[1]
  finally:
    monkeypatch.delenv(compat.DISABLE_ENV)
    compat.revert()
    compat.apply()


def _reshuffled_fit(strategy):
  """2 epochs of SGD on a dataset reshuffled each epoch: the weights depend on the batches' order."""
  rng = np.random.RandomState(1)
  x = rng.uniform(-1, 1, size=(64, 4)).astype("float32")
  y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
  keras.utils.set_random_seed(5)  # Before the dataset: its shuffle seeds depend on it.
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=2).batch(16)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.2), "mse")
  model.fit(dataset, epochs=2, verbose=0)
  return np.concatenate([w.ravel() for w in model.get_weights()])


def test_a_strategy_trains_on_the_batches_of_a_single_device_run():
  """Upstream's symbolic build makes an iterator of the input, which draws the next shuffle seeds."""
  single = _reshuffled_fit(tf.distribute.get_strategy())
  mirrored = tf.distribute.MirroredStrategy(
      _CPUS, cross_device_ops=tf.distribute.ReductionToOneDevice())
  patched = _reshuffled_fit(mirrored)
  compat.revert()
  try:
    upstream = _reshuffled_fit(mirrored)
  finally:
    compat.apply()
  # 2 replicas x 8 rows == 1 x 16 rows, up to the order of the reductions.
  np.testing.assert_allclose(patched, single, rtol=1e-5, atol=1e-6)
  assert np.abs(upstream - single).max() > 1e-2  # other batches in each epoch


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
  import inspect  # pylint: disable=g-import-not-at-top
  trainer = keras.src.backend.tensorflow.trainer
  upstream = inspect.unwrap(trainer.reduce_per_replica)
  compat.revert()
  try:
    assert not compat.applied()
    assert trainer.reduce_per_replica is upstream
    assert not hasattr(trainer.reduce_per_replica, "__tfdp_compat_fix__")
  finally:
    compat.apply()
  # Two fixes patch it, the later around the earlier.
  assert trainer.reduce_per_replica.__tfdp_compat_fix__ == "concat_gather_dtypes"
  assert trainer.reduce_per_replica.__wrapped__.__tfdp_compat_fix__ == "reduce_mean_axis"
  assert trainer.reduce_per_replica.__wrapped__.__wrapped__ is upstream


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
                                probe=lambda: ["reduce_per_replica changed"])
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
    assert fix.changes() == [], name
