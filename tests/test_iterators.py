"""tfdp.data.checkpointable in-process: TF's elements, an exact saved position, and clear limits.

The in-process tests mirror over 2 logical CPUs (tests/conftest.py).
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import callbacks
from tfdp import errors
from tfdp.resume import fit_hooks
from tfdp.data import iterators
from tfdp.data import iterator_state
from tfdp.distribute import strategy as strategy_lib  # `strategy` is this file's fixture


@pytest.fixture(scope="module")
def strategy():
  devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
  assert len(devices) == 2
  return tf.distribute.MirroredStrategy(devices)


def _pipeline(symbolic=False):
  ds = (tf.data.Dataset.range(1000).shuffle(50, seed=1)
        .map(lambda x: (x, tf.random.stateless_uniform([], seed=tf.stack([x, x]))))
        .batch(8).prefetch(2))
  if symbolic:
    options = tf.data.Options()
    options.experimental_symbolic_checkpoint = True
    ds = ds.with_options(options)
  return ds


def _local(strategy, value):
  return [np.concatenate([t.numpy() for t in strategy.experimental_local_results(v)])
          for v in value]


def test_same_elements_as_stock_and_an_exact_position_through_tf_checkpoint(strategy, tmp_path):
  stock = iter(strategy.experimental_distribute_dataset(_pipeline()))
  it = iter(iterators.checkpointable(_pipeline(), strategy))

  @tf.function
  def step(iterator):
    return next(iterator)

  expected = [_local(strategy, next(stock)) for _ in range(6)]
  got = [_local(strategy, step(it)) for _ in range(3)]
  path = tf.train.Checkpoint(data=it).write(str(tmp_path / "ckpt"))
  got += [_local(strategy, step(it)) for _ in range(3)]
  for a, b in zip(expected, got):
    np.testing.assert_array_equal(a[0], b[0])
  again = iter(iterators.checkpointable(_pipeline(), strategy))
  tf.train.Checkpoint(data=again).read(path).assert_consumed()
  for a in expected[3:]:
    np.testing.assert_array_equal(a[0], _local(strategy, step(again))[0])
  assert step.experimental_get_tracing_count() == 1  # a composite tensor, like TF's


def test_pending_state_goes_into_the_next_iterator_after_aligning_the_count(strategy):
  dist = iterators.checkpointable(_pipeline(), strategy)
  first = iter(dist)
  next(first)
  state = first.state()
  expected = _local(strategy, next(first))
  fresh = iterators.checkpointable(_pipeline(), strategy)
  fresh.set_pending(state, iterators_made=3)
  resumed = iter(fresh)
  assert fresh.iterators_made == 4 and resumed._index == 4  # pylint: disable=protected-access
  np.testing.assert_array_equal(expected[0], _local(strategy, next(resumed))[0])


def test_no_strategy_gives_local_iterators():
  dist = iterators.checkpointable(_pipeline(), tf.distribute.get_strategy())
  it = iter(dist)
  next(it)
  state = it.state()
  expected = next(it)[0].numpy()
  again = iter(iterators.checkpointable(_pipeline(), tf.distribute.get_strategy()))
  again.restore_state(state)
  np.testing.assert_array_equal(expected, next(again)[0].numpy())


def test_a_stateful_random_op_saves_the_position_with_a_warning(strategy, caplog):
  ds = tf.data.Dataset.range(100).map(
      lambda x: tf.cast(x, tf.float32) + tf.random.uniform([], seed=1)).batch(4)
  it = iter(iterators.checkpointable(ds, strategy))
  next(it)
  assert it.state() and it.state()
  warnings = [r for r in caplog.records if "RandomUniform is stateful" in r.getMessage()]
  assert len(warnings) == 1  # once per dataset


def test_python_state_and_symbolic_under_two_replicas_are_refused(strategy):
  gen = tf.data.Dataset.from_generator(lambda: iter(range(10)),
                                       output_signature=tf.TensorSpec([], tf.int64)).batch(2)
  it = iter(iterators.checkpointable(gen, strategy))
  next(it)
  with pytest.raises(errors.CheckpointError, match="PyFunc is stateful"):
    it.state()
  it = iter(iterators.checkpointable(_pipeline(symbolic=True), strategy))
  next(it)
  with pytest.raises(errors.CheckpointError, match="Rebatch.*symbolic"):
    it.state()


def test_nondeterministic_orders_are_named():
  assert iterator_state.nondeterminism(_pipeline()) == []
  parallel = tf.data.Dataset.range(5).map(lambda x: x, num_parallel_calls=2, deterministic=False)
  assert iterator_state.nondeterminism(parallel) == ["ParallelMapDatasetV2 has deterministic=False"]


@pytest.mark.parametrize("mirrored", [False, True], ids=["no_strategy", "mirrored"])
def test_fit_frees_the_iterators_it_made_when_it_returns(tmp_path, mirrored):
  """No reference cycle keeps a finished fit's tf.data iterator alive until a GC pass.

  Such a cycle (the dataset holding its newest iterator, the iterator its
  dataset; the backup's data position holding the iterator) kept the
  iterator and its buffers until Python's cyclic GC ran, and that GC then
  froze the process while it freed it: TF 2.21's iterator can miss the
  wake-up of its cancellation and sleep out its autotuning period, up to
  60 s, holding the GIL (seen as 8-62 s stalls in this suite).
  """
  made = []

  class Grab(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      it = fit_hooks.current(self.model).dataset.current
      if it is not None and all(r() is not it for r in made):
        made.append(weakref.ref(it))

  # make_strategy's CPU replicas reduce on one device: TF's default collective
  # ops clash with other strategies' in one process (see test_compat._mirrored_fit).
  scope = (strategy_lib.make_strategy("mirrored", cpu_replicas=2) if mirrored
           else tf.distribute.get_strategy()).scope()
  with scope:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
  x = np.arange(64 * 4, dtype="float32").reshape(64, 4) / 256
  data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).shuffle(64, seed=1).batch(8)
  backup = callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=3,
                                      delete_checkpoint=False)
  gc.disable()
  try:
    model.fit(data, epochs=2, verbose=0, callbacks=[Grab(), backup])
    alive = [r() for r in made if r() is not None]
  finally:
    gc.enable()
  assert len(made) >= 2, made  # One iterator per epoch (a finite dataset, no steps_per_epoch).
  assert not alive, [type(a).__name__ for a in alive]
  assert backup.position.data._base is None  # pylint: disable=protected-access
