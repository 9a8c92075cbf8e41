"""The cached reads of frequent saves (tfdp.checkpoint.format.reads) hold what TF's own save reads, at the step they are taken."""

import os

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.local.options import LocalOptions
from tfdp.checkpoint.manager import CheckpointManager
from tfdp.resume import train_state


class _Counter(tf.train.experimental.PythonState):
  """A user's Python state: its value changes as training goes."""

  def __init__(self):
    self.n = 0

  def serialize(self):
    return str(self.n)

  def deserialize(self, string_value):
    self.n = int(string_value)


def _manager(root, ckpt, **kw):
  return CheckpointManager(ckpt, os.path.join(root, "model"), local_options=LocalOptions(
      every_steps=1, directory=os.path.join(root, "local")), **kw)


def test_a_local_copy_holds_the_python_state_of_its_own_step(tmp_path):
  """A traced read would hold a Python state's value of its first save; every copy holds its own."""
  counter, v = _Counter(), tf.Variable(0.0)
  manager = _manager(str(tmp_path), tf.train.Checkpoint(v=v, counter=counter))
  try:
    for step in (1, 2, 3):
      counter.n, _ = 10 * step, v.assign(float(step))
      manager.save_local(step)
    manager.sync()
  finally:
    manager.close()
  fresh, w = _Counter(), tf.Variable(0.0)
  again = _manager(str(tmp_path), tf.train.Checkpoint(v=w, counter=fresh))
  try:
    assert again.restore_or_initialize().endswith("ckpt-3")
  finally:
    again.close()
  assert (fresh.n, float(w.numpy())) == (30, 3.0)


def test_a_persistent_save_after_the_objects_changed_holds_the_new_ones(tmp_path):
  """The traced read is made again when an object joined the checkpoint, and per-worker state's walk too."""
  own = tf.Module()
  own.a = tf.Variable(1.0)
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  manager = _manager(str(tmp_path), ckpt, per_worker={"own": own})
  try:
    manager.save_at_step(1, persistent=True)
    ckpt.w = tf.Variable(2.0)
    own.b = tf.Variable(3.0)
    manager.save_at_step(2, persistent=True)
    manager.sync()
    reader = tf.train.load_checkpoint(manager.latest_checkpoint)
    names = set(reader.get_variable_to_shape_map())
  finally:
    manager.close()
  assert reader.get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE") == 2.0
  assert any(n.endswith("own/b/.ATTRIBUTES/VARIABLE_VALUE") for n in names), sorted(names)


def test_the_cached_reads_name_and_read_what_a_full_read_does():
  """Side by side with TF's walk: the same keys, slices and values, Python state included."""
  counter = _Counter()
  counter.n = 7
  module = tf.Module()
  module.table = tf.Variable(tf.reshape(tf.range(6.0), [2, 3]))
  ckpt = tf.train.Checkpoint(m=module, counter=counter, step=tf.Variable(5, dtype=tf.int64))
  full = reads.tensors(ckpt)
  cached = reads.CachedGather(ckpt)
  for _ in range(2):  # Traced, then from the trace.
    got = cached()
    assert [(it.key, it.slice_spec) for it in got] == [(k, s) for k, s, _ in full]
    for it, (_, _, value) in zip(got, full):
      if it.key != "_CHECKPOINTABLE_OBJECT_GRAPH":
        np.testing.assert_array_equal(it.value.numpy(), value.numpy())
  walk = reads.CachedWalk(ckpt, "p/")
  for _ in range(2):  # Walked, then asked.
    assert [(it.key, it.slice_spec) for it in walk()] == [
        ("p/" + k, s) for k, s, _ in reads.tensors(ckpt, with_object_graph=False)]


def test_the_global_step_is_the_optimizers_iterations_under_a_strategy():
  # tfdp's strategy: its collectives have keys of their own (a second plain
  # MirroredStrategy in the session would reuse the instance keys of another).
  strategy = tfdp.make_strategy(cpu_replicas=2)
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  model.fit(np.zeros((8, 2)), np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
  assert train_state.global_step(model) == int(model.optimizer.iterations.numpy()) == 2


def test_the_object_graph_is_one_tensor_at_every_read_until_the_objects_change():
  """The traced read's object graph is a constant of its trace: one tensor, so the local writer makes it into bytes once, not at every save."""
  module = tf.Module()
  module.a = tf.Variable(1.0)
  ckpt = tf.train.Checkpoint(m=module)
  cached = reads.CachedGather(ckpt)

  def graph():
    (value,) = [it.value for it in cached() if it.key == "_CHECKPOINTABLE_OBJECT_GRAPH"]
    return value

  first = graph()
  assert graph() is first and graph() is first
  module.b = tf.Variable(2.0)  # A new object: a new trace, and its own object graph.
  cached.check()
  second = graph()
  assert second is not first and second.numpy() != first.numpy()
  assert b"b" in second.numpy() and graph() is second


def test_a_python_value_saves_and_restores_as_a_variable_of_its_name_does(tmp_path):
  """`reads.PythonValue` beside the `tf.Variable` it stands for: the same keys, dtypes and values in TF's checkpoint, each restoring into the other; the cached read holds each save's value."""
  def objects(kind):
    make = (lambda v: tf.Variable(v, dtype=tf.int64)) if kind == "variable" else (
        lambda v: reads.PythonValue(v, tf.int64))
    return make(-1), make([0, 0])

  saved = {}
  for kind in ("variable", "python"):
    step, topology = objects(kind)
    step.assign(41)
    topology.assign([2, 4])
    ckpt = tf.train.Checkpoint(keras_step_in_epoch=step, data_topology=topology)
    saved[kind] = ckpt.write(str(tmp_path / kind / "ckpt"))
  readers = [tf.train.load_checkpoint(saved[k]) for k in saved]
  dtypes = [r.get_variable_to_dtype_map() for r in readers]
  assert dtypes[0] == dtypes[1], dtypes
  shapes = [r.get_variable_to_shape_map() for r in readers]
  assert shapes[0] == shapes[1], shapes
  for written, kind in (("variable", "python"), ("python", "variable")):
    step, topology = objects(kind)
    tf.train.Checkpoint(keras_step_in_epoch=step, data_topology=topology).read(
        saved[written]).assert_consumed()
    assert (int(step.numpy()), list(topology.numpy())) == (41, [2, 4]), (written, kind)

  # The local tier's copies (tfdp's cached read and restore): each holds its own step's value.
  step, topology = objects("python")
  manager = _manager(str(tmp_path / "tier"), tf.train.Checkpoint(
      keras_step_in_epoch=step, data_topology=topology))
  try:
    for n in (1, 2, 3):
      step.assign(n * 10)
      manager.save_local(n)
    manager.sync()
  finally:
    manager.close()
  for made in ("python", "variable"):
    step, topology = objects(made)
    again = _manager(str(tmp_path / "tier"), tf.train.Checkpoint(
        keras_step_in_epoch=step, data_topology=topology))
    try:
      assert again.restore_or_initialize().endswith("ckpt-3")
    finally:
      again.close()
    assert int(step.numpy()) == 30, made
