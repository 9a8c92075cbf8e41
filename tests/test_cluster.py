"""Tests of tfdp.cluster: each step of the resolution order, the ConfigError, SLURM, and agree() across 2 real workers."""

import dataclasses
import json

import keras
import pytest
import tensorflow as tf

from tests import identity_run
from tfdp import cluster
from tfdp import errors


def _tf_config(workers=2, index=0, task_type="worker", chief=False, evaluator=False):
  spec = {"worker": [f"localhost:{3000 + i}" for i in range(workers)]}
  if chief:
    spec["chief"] = ["localhost:2999"]
  if evaluator:
    spec["evaluator"] = ["localhost:2998"]
  return json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}})


@pytest.fixture
def env(monkeypatch):
  """A clean environment: no TF_CONFIG, no SLURM step; returns monkeypatch."""
  monkeypatch.delenv("TF_CONFIG", raising=False)
  for k in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
    monkeypatch.delenv(k, raising=False)
  return monkeypatch


@pytest.fixture(scope="module")
def local_mwms():
  """A MultiWorkerMirroredStrategy of this one process (no TF_CONFIG: one worker)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv("TF_CONFIG", raising=False)
    return tf.distribute.MultiWorkerMirroredStrategy()


def test_worker_is_a_frozen_record_and_index_0_is_the_chief():
  w = cluster.Worker(0, 2, "h:1", None)
  assert w.is_chief and not cluster.Worker(1, 2).is_chief
  with pytest.raises(dataclasses.FrozenInstanceError):
    w.index = 1  # pytype: disable=not-writable


def test_explicit_index_and_count_win_over_everything(env, local_mwms):
  env.setenv("TF_CONFIG", _tf_config(4, 3))
  with local_mwms.scope():
    assert cluster.resolve(local_mwms, worker_index=1, num_workers=3) == cluster.Worker(1, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(worker_index=0), "both worker_index and num_workers"),
    (dict(num_workers=2), "both worker_index and num_workers"),
    (dict(worker_index=2, num_workers=2), r"must be in \[0, num_workers=2\)"),
    (dict(worker_index=-1, num_workers=2), r"must be in \[0, num_workers=2\)"),
])
def test_explicit_arguments_are_checked(env, kwargs, match):
  with pytest.raises(errors.ConfigError, match=match):
    cluster.resolve(**kwargs)


def test_the_strategy_passed_decides(env, local_mwms):
  w = cluster.resolve(local_mwms)
  assert (w.index, w.count, w.strategy) == (0, 1, local_mwms)


def test_the_strategy_in_scope_decides(env, local_mwms):
  with local_mwms.scope():
    assert cluster.resolve().strategy is local_mwms
    # A single-host strategy passed does not hide the multi-worker one in scope.
    assert cluster.resolve(tf.distribute.get_strategy()).strategy is local_mwms
  assert cluster.resolve().strategy is None


def test_the_owner_of_the_checkpoints_variables_decides(env, local_mwms):
  with local_mwms.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
  # A step counter made outside the scope is a plain variable: it says nothing.
  step = tf.Variable(0, dtype=tf.int64)
  checkpoint = tf.train.Checkpoint(step=step, model=model, optimizer=optimizer)
  assert cluster.strategy_of(checkpoint) is local_mwms
  assert cluster.strategy_of(model) is local_mwms
  assert cluster.strategy_of(model.variables) is local_mwms
  assert cluster.strategy_of({"w": model.variables[0]}) is local_mwms
  assert cluster.strategy_of([step]) is None
  assert cluster.strategy_of(None) is None
  w = cluster.resolve(objects=checkpoint)
  assert w.strategy is local_mwms and (w.index, w.count) == (0, 1)
  assert cluster.resolve(objects=[step]).strategy is None


def test_variables_of_a_single_host_strategy_name_no_multi_worker_one(env):
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with mirrored.scope():
    v = tf.Variable(1.0)
  assert cluster.strategy_of(tf.train.Checkpoint(v=v)) is None
  assert cluster.resolve(mirrored, objects=[v]) == cluster.Worker(0, 1)


def test_no_strategy_and_no_environment_is_one_worker(env):
  assert cluster.resolve() == cluster.Worker(0, 1)


def test_a_one_worker_tf_config_gives_the_address(env):
  env.setenv("TF_CONFIG", _tf_config(1, 0))
  assert cluster.resolve() == cluster.Worker(0, 1, "localhost:3000", None, ("worker", 0))


@pytest.mark.parametrize("config, where", [
    (_tf_config(2, 1), "TF_CONFIG describes 2 workers (this is worker 1)"),
    (_tf_config(2, 1, chief=True), "TF_CONFIG describes 3 workers (this is worker 2)"),
    (_tf_config(2, 0, task_type="chief", chief=True),
     "TF_CONFIG describes 3 workers (this is worker 0)"),
])
def test_a_multi_worker_environment_without_a_multi_worker_strategy_is_refused(
    env, config, where):
  env.setenv("TF_CONFIG", config)
  with pytest.raises(errors.ConfigError) as e:
    cluster.resolve(tf.distribute.get_strategy())
  message = str(e.value)
  assert where in message
  assert "build and compile the model inside `with strategy.scope():`" in message, message
  assert "strategy=" in message, message
  assert "worker_index= and num_workers=" in message


def test_an_evaluator_is_no_training_worker(env):
  env.setenv("TF_CONFIG", _tf_config(1, 0, task_type="evaluator", evaluator=True))
  with pytest.raises(errors.ConfigError, match="'evaluator' task, which is not a training"):
    cluster.resolve()


def test_a_bad_tf_config_is_a_config_error(env):
  env.setenv("TF_CONFIG", _tf_config(2, 5))
  with pytest.raises(errors.ConfigError, match="index 5 is out of range"):
    cluster.resolve()


def test_a_one_worker_strategy_in_a_bigger_environment_is_refused(env, local_mwms):
  env.setenv("TF_CONFIG", _tf_config(2, 0))
  with pytest.raises(errors.ConfigError, match="TF_CONFIG describes 2 workers but the MultiWorker"):
    cluster.resolve(local_mwms)


def test_slurm_step(env):
  env.setenv("SLURM_PROCID", "1")
  env.setenv("SLURM_STEP_NUM_TASKS", "3")
  with pytest.raises(errors.ConfigError,
                     match=r"the SLURM job step describes 3 workers \(this is worker 1\)"):
    cluster.resolve()
  # TF_CONFIG wins over SLURM.
  env.setenv("TF_CONFIG", _tf_config(1, 0))
  assert cluster.resolve().count == 1
  env.delenv("TF_CONFIG")
  env.setenv("SLURM_PROCID", "0")
  env.setenv("SLURM_STEP_NUM_TASKS", "1")
  assert cluster.resolve() == cluster.Worker(0, 1, None, None, ("worker", 0))


def test_agree_without_multi_worker_returns_the_value(env, local_mwms):
  assert cluster.agree(3.5) == 3.5
  assert cluster.agree(2.0, "sum", local_mwms) == 2.0
  assert not cluster.is_multi_worker(local_mwms)
  assert cluster.peers(local_mwms) == ()
  with pytest.raises(errors.ConfigError, match="Unknown op 'mean'"):
    cluster.agree(1.0, "mean")


@pytest.mark.slow
def test_resolve_and_agree_across_two_real_workers():
  code, out, results = identity_run.results("cluster")
  assert code == 0, out[-5000:]
  # Each worker has 2 local replicas; only one per worker contributes, so the
  # sum is 10 + 11, not twice that. Outside the scope with nothing to go on,
  # resolve() refuses rather than answering "0 of 1"; the checkpoint's
  # variables name the strategy.
  assert results == [
      "0 2 True ('worker', 0) (('worker', 1),) True True True 11.0 10.0 21.0 True True",
      "1 2 False ('worker', 1) (('worker', 0),) True True True 11.0 10.0 21.0 True True",
  ], out[-5000:]
