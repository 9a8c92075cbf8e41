"""What a save costs the training step: a snapshot only; bytes, files and records on the writer."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_dataset_ops

from tfdp import callbacks
from tfdp.checkpoint.schedule import policy

X = np.random.RandomState(0).normal(size=(256, 8)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"),
                            keras.layers.Dense(1, name="b")], name="m")
  model.compile(keras.optimizers.Adam(0.01), "mse")
  return model


@pytest.mark.parametrize("tier", ["local", "async", "sync", "both"])
def test_the_step_serializes_nothing(tmp_path, monkeypatch, tier):
  """Counted inside the step (the training thread): SerializeIterator takes a variant; no bytes are made there.

  serialize_tensor (a variant or any tensor to bytes) runs on the writer
  thread for local and async saves. A sync save returns once committed, so
  its writing is in the step by definition: there only the count of
  SerializeIterator calls (the capture) is checked. With both tiers at every
  saving step, one snapshot serves both: each state taken is made into
  bytes once.
  """
  calls = {"SerializeIterator": [], "SerializeTensor": []}
  variants = []
  real_capture, real_bytes = gen_dataset_ops.serialize_iterator, tf.io.serialize_tensor

  def capture(*a, **k):
    calls["SerializeIterator"].append(threading.current_thread().name)
    return real_capture(*a, **k)

  def to_bytes(value, *a, **k):
    calls["SerializeTensor"].append(threading.current_thread().name)
    if value.dtype == tf.variant:
      variants.append(value)  # Held: ids stay unique.
    return real_bytes(value, *a, **k)

  monkeypatch.setattr(gen_dataset_ops, "serialize_iterator", capture)
  monkeypatch.setattr(tf.io, "serialize_tensor", to_bytes)
  kw = (dict(save_freq=False if tier == "local" else 2, async_save=True,
             local_checkpoint_every_steps=2, local_checkpoint_dir=str(tmp_path / "local"))
        if tier in ("local", "both") else dict(save_freq=2, async_save=tier == "async"))
  backup = callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False, **kw)
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(256, seed=1).batch(8).repeat()
  _model().fit(dataset, epochs=1, steps_per_epoch=20, verbose=0, callbacks=[backup])
  main = threading.main_thread().name
  in_step = {op: [t for t in threads if t == main] for op, threads in calls.items()}
  assert 1 <= len(in_step["SerializeIterator"]) <= 10, calls  # At most one capture a save.
  if tier != "sync":
    assert not in_step["SerializeTensor"], calls
    assert calls["SerializeTensor"], calls  # ... made on the writer.
  assert variants and len({id(v) for v in variants}) == len(variants), calls  # Each once.


def test_auto_interval_is_the_smallest_within_the_budget():
  rule = policy.EveryAutoSteps(0.02)
  assert rule.interval_for(save_seconds=0.001, step_seconds=0.1) == 1
  assert rule.interval_for(save_seconds=0.010, step_seconds=0.1) == 5
  assert rule.interval_for(save_seconds=0.011, step_seconds=0.1) == 6
  assert rule.interval_for(save_seconds=100.0, step_seconds=0.001) == 10_000
  rule.interval = 4
  ctx = policy.SaveContext
  assert [rule.should_save(ctx(step=s, previous_step=s - 3)) for s in (3, 6, 9)] == [
      False, True, True]
  with pytest.raises(ValueError, match="checkpoint_overhead"):
    policy.EveryAutoSteps(0.0)
  assert policy.every_steps("auto") == "auto" and policy.every_steps("7") == 7
  with pytest.raises(ValueError, match="positive number of steps or 'auto'"):
    policy.every_steps("often")


def test_auto_cadence_measures_agrees_and_saves_on_its_interval(tmp_path):
  """Plain fit with local saves on "auto": the interval follows the measured costs and is used."""
  backup = callbacks.BackupAndRestore(
      str(tmp_path / "backup"), save_freq=False, delete_checkpoint=False,
      local_checkpoint_every_steps="auto", checkpoint_overhead=0.02,
      local_checkpoint_dir=str(tmp_path / "local"))
  seen = []

  class Watch(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      seen.append(backup.manager.local_interval)

  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
  _model().fit(dataset, epochs=1, steps_per_epoch=80, verbose=0, callbacks=[backup, Watch()])
  assert seen[0] == 1 and all(isinstance(n, int) and n >= 1 for n in seen), seen
  assert backup.manager.local_checkpoint_every_steps == "auto"
  costs = list(backup.manager._local.costs)  # pylint: disable=protected-access
  assert costs and all(b >= 0 and w >= 0 for b, w in costs), costs


def test_the_callbacks_work_at_a_step_is_a_few_ops_whatever_the_model(tmp_path, monkeypatch):
  """Counted on the training thread inside the callback: a step that saves nothing runs one TF op (the step's read); a local save three, not one per variable.

  A local save's three: the step's read, one call reading the variables,
  one reading the metrics' state. The position in the epoch is set without
  an op (a variable's assign was a fourth, one per replica under a strategy).
  """
  from tensorflow.python import pywrap_tfe  # pylint: disable=g-import-not-at-top
  ops, inside = [], threading.local()
  for name in ("TFE_Py_FastPathExecute", "TFE_Py_Execute"):
    real = getattr(pywrap_tfe, name)

    def counted(*a, real=real, name=name, **k):
      if getattr(inside, "step", None) is not None:
        ops[-1].append(name)
      return real(*a, **k)

    monkeypatch.setattr(pywrap_tfe, name, counted)
  real_end = callbacks.BackupAndRestore.on_train_batch_end

  def end(self, batch, logs=None):
    inside.step, _ = batch, ops.append([])
    try:
      return real_end(self, batch, logs)
    finally:
      inside.step = None

  monkeypatch.setattr(callbacks.BackupAndRestore, "on_train_batch_end", end)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(6)])
  model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])  # 37 variables to save.
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(256, seed=1).batch(8).repeat()
  for every, most in ((None, 1), (1, 3)):
    ops.clear()
    kw = {} if every is None else dict(local_checkpoint_every_steps=every,
                                       local_checkpoint_dir=str(tmp_path / "local"))
    backup = callbacks.BackupAndRestore(str(tmp_path / f"b{every}"), save_freq=False, **kw)
    model.fit(dataset, epochs=1, steps_per_epoch=12, verbose=0, callbacks=[backup])
    counts = [len(step) for step in ops[2:]]  # After the first saves traced their reads.
    assert counts and max(counts) <= most, (every, ops)


def test_a_models_config_is_made_into_text_once_not_at_every_save(tmp_path, monkeypatch):
  """A backup holds the model's Keras config (169 KB of JSON for a ResNet-50, 8 ms to make): made once, not on the training thread at every save."""
  import json  # pylint: disable=g-import-not-at-top
  from tfdp.resume import train_state  # pylint: disable=g-import-not-at-top
  made = []

  class CountingJson:
    loads = staticmethod(json.loads)

    @staticmethod
    def dumps(value, **kw):
      if isinstance(value, dict) and value.get("class_name") == "Sequential":
        made.append(threading.current_thread().name)
      return json.dumps(value, **kw)

  monkeypatch.setattr(train_state, "json", CountingJson)
  model = _model()
  backup = callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq="epoch",
                                      local_checkpoint_every_steps=1,
                                      local_checkpoint_dir=str(tmp_path / "local"),
                                      delete_checkpoint=False)
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
  model.fit(dataset, epochs=1, steps_per_epoch=12, verbose=0, callbacks=[backup])
  assert 1 <= len(made) <= 2, made  # model_config's check that it is JSON, and its text.
  saved = train_state.read_model_config(backup.manager.latest_checkpoint)
  assert saved == json.loads(json.dumps(train_state.model_config(model)))
