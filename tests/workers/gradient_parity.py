"""The gradient path side by side with stock Keras and one device: a small model trained by a custom loop and by `fit`, with each optimizer option.

Used in process by tests/test_gradient_path.py (MirroredStrategy over 2
logical CPUs) and by tests/workers/gradient_worker.py (case `parity`: the
user's own MultiWorkerMirroredStrategy on 2 workers under tfdp-launch).

Every run trains the same model from the same seed on the same STEPS global
batches of GLOBAL rows; replica r of n trains on rows [r*GLOBAL/n,
(r+1)*GLOBAL/n) of each. The custom loop is TF's tutorial loop in Keras 3,
run eagerly (stock Keras cannot trace gradient accumulation under these
strategies): `strategy.run` of a step that takes the replica's rows, divides
the summed loss by the global batch size, scales it
(`optimizer.scale_loss`) and calls `optimizer.apply_gradients`. `fit` is
plain `model.fit` on a dataset of the global batches. With option
`loss_scale` (mixed_float16, a LossScaleOptimizer) replica 1's rows of the
first batch overflow float16 at the initial loss scale.

`run_all` runs each (loop, option) under the strategy with tfdp's gradient
path, and, for the options where stock Keras is right (`UPSTREAM_RIGHT`),
with the path off (`stock_keras`), in one process.
"""

import contextlib
import os

import keras
import numpy as np
import tensorflow as tf

from tfdp import compat

GLOBAL, STEPS, FEATURES = 16, 4, 12
LOOPS = ("custom", "fit")
OPTIONS = {
    "plain": lambda: keras.optimizers.SGD(0.5),
    "accumulation": lambda: keras.optimizers.SGD(0.5, gradient_accumulation_steps=2),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
}
# Stock Keras reduces these as one device does; it clips each replica's own
# gradients and decides a loss-scale overflow from replica 0's alone.
UPSTREAM_RIGHT = ("plain", "accumulation")


def data():
  """The global batches, rows in order: (x, y)."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(GLOBAL * STEPS, FEATURES)).astype("float32") * 3
  y = (x[:, :3].sum(axis=1) > 0).astype("int32")
  return x, y


def _replica_rows(x, step, replica, replicas):
  share = GLOBAL // replicas
  start = step * GLOBAL + replica * share
  return x[start:start + share]


def _build(strategy, option, run_eagerly):
  policy = "mixed_float16" if option == "loss_scale" else "float32"
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope():
      keras.utils.set_random_seed(5)
      model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(2, dtype="float32")])
      model.compile(optimizer=OPTIONS[option](),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    run_eagerly=run_eagerly)
      model.optimizer.build(model.trainable_variables)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  return model


def _custom(strategy, model, x, y):
  optimizer, replicas = model.optimizer, strategy.num_replicas_in_sync

  def step(xb, yb):
    with tf.GradientTape() as tape:
      per_row = keras.losses.sparse_categorical_crossentropy(yb, model(xb, training=True),
                                                             from_logits=True)
      loss = optimizer.scale_loss(tf.reduce_sum(per_row) / GLOBAL)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  for k in range(STEPS):
    inputs = [strategy.experimental_distribute_values_from_function(
        lambda ctx, a=a: _replica_rows(a, k, ctx.replica_id_in_sync_group, replicas))  # pylint: disable=cell-var-from-loop
              for a in (x, y)]
    strategy.run(step, args=tuple(inputs))


def _fit(model, x, y):
  # Under either strategy, tf.distribute splits each global batch in
  # replica order (on 2 workers: rebatched, then sharded by batch).
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL), epochs=1, verbose=0,
            shuffle=False)


def train(strategy, loop, option, run_eagerly=False):
  """Trains the model under `strategy` by `loop` with `option`; returns its weights, loss scale and step."""
  x, y = data()
  if option == "loss_scale":  # replica 1's rows of the first batch overflow float16
    x[GLOBAL // 2:GLOBAL] *= 3e4
  model = _build(strategy, option, run_eagerly)
  if loop == "custom":
    _custom(strategy, model, x, y)
  else:
    _fit(model, x, y)
  weights = np.concatenate([np.asarray(v).astype("float64").ravel() for v in model.weights])
  scale = getattr(model.optimizer, "dynamic_scale", None)
  return {"weights": weights,
          "scale": np.float64(np.nan if scale is None else scale.numpy()),
          "iterations": np.int64(model.optimizer.iterations.numpy())}


@contextlib.contextmanager
def stock_keras():
  """Keras's own gradient path in this process: tfdp's gradient_path fix off, every other fix on."""
  before = os.environ.get(compat.DISABLE_ENV)
  os.environ[compat.DISABLE_ENV] = "gradient_path"
  compat.revert()
  compat.apply()
  try:
    yield
  finally:
    if before is None:
      del os.environ[compat.DISABLE_ENV]
    else:
      os.environ[compat.DISABLE_ENV] = before
    compat.revert()
    compat.apply()


def run_all(strategy):
  """Every (loop, option) under `strategy`, tfdp's then stock Keras's: {"tfdp/loop/option": result, "stock/...": ...}."""
  results = {f"tfdp/{loop}/{option}": train(strategy, loop, option)
             for loop in LOOPS for option in OPTIONS}
  with stock_keras():
    # Stock Keras cannot trace accumulation under a strategy that merges
    # ("`merge_call` called while defining a new graph"): its fit runs eagerly.
    results.update({f"stock/{loop}/{option}": train(
        strategy, loop, option, run_eagerly=loop == "fit" and option == "accumulation")
                    for loop in LOOPS for option in UPSTREAM_RIGHT})
  return results


def one_device():
  """Every (loop, option) on one device (no strategy): {"one/loop/option": result}."""
  strategy = tf.distribute.get_strategy()
  return {f"one/{loop}/{option}": train(strategy, loop, option)
          for loop in LOOPS for option in OPTIONS}
