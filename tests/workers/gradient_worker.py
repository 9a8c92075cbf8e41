"""Worker of tests/test_gradient_path.py: the user's own MultiWorkerMirroredStrategy and plain fit, with `import tfdp` first.

Usage: gradient_worker.py OUT_DIR CASE[,CASE...]

The script is what a user writes: `import tfdp` before TensorFlow and Keras,
no other tfdp call (tfdp.configure_gradients aside, where a case sets the
gradient path), `tf.distribute.MultiWorkerMirroredStrategy()` and
`model.fit` on a `tf.data` pipeline that every worker builds from its own
data (`AutoShardPolicy.OFF`). Cases, run one after the other in one process:

- `f16`: mixed_float16 with dynamic loss scaling; every row of worker 1's
  first batch overflows float16 at the initial scale, worker 0's do not.
- `buckets`: the same fp32 run with buckets of 4 KB and with buckets off
  (`bucket_cap_mb=0`); it records the all-reduces the traced step holds.
- `bf16`: the fp32 run with gradient_compression="bf16".
- `parity`: tests/workers/gradient_parity.py's custom loops and fits, each
  optimizer option, with tfdp's gradient path and (where stock Keras is
  right) without it; it writes OUT_DIR/parity-<worker>.npz, keys
  "<path>/<loop>/<option>/<field>".
- `stall`: a collective timeout of STALL_TIMEOUT s; worker 0 stops in a
  callback after step STALL_AT, so worker 1 waits alone in the next step's
  collectives (the case ends the process).

Each case writes OUT_DIR/<case>-<worker>.npz: the weights, the optimizer's
step and (f16) its loss scale, and the all-reduces of the traced step.
"""

import os
import sys
import time

import tfdp  # first, before TensorFlow and Keras
import tfdp.gradients.settings  # reset between cases

import numpy as np  # pylint: disable=g-bad-import-order,wrong-import-order
import tensorflow as tf  # pylint: disable=g-bad-import-order,wrong-import-order
import keras  # pylint: disable=g-bad-import-order,wrong-import-order

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.workers import gradient_parity  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH, STEPS = 16, 6
STALL_AT, STALL_TIMEOUT = 3, 4.0


def data(worker, overflow):
  """Worker `worker`'s rows: 20 features, 2 classes; `overflow` makes its first batch overflow float16."""
  rng = np.random.default_rng(100 + worker)
  x = rng.normal(size=(BATCH * STEPS, 20)).astype("float32")
  y = (x[:, :3].sum(axis=1) > 0).astype("int32")
  if overflow:
    x[:BATCH] *= 3e4
  return x, y


def dataset(x, y):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).with_options(options)


def build(strategy, policy="float32"):
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope():
      keras.utils.set_random_seed(7)
      model = keras.Sequential([
          keras.Input((20,)),
          keras.layers.Dense(64, activation="relu"),
          keras.layers.Dense(64, activation="relu"),
          keras.layers.Dense(2, dtype="float32"),
      ])
      model.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
  finally:
    keras.mixed_precision.set_global_policy("float32")


def all_reduces(model):
  """The dtypes of the collective all-reduces in the traced train step (and the functions it calls)."""
  functions, todo = [], [model.train_function]
  while todo:  # Keras's train_function is a Python function around the tf.function(s)
    fn = todo.pop()
    if hasattr(fn, "_list_all_concrete_functions"):
      functions.append(fn)
    else:
      todo += [c.cell_contents for c in getattr(fn, "__closure__", None) or ()
               if callable(c.cell_contents)]
  found = []
  for concrete in (c for f in functions for c in f._list_all_concrete_functions()):  # pylint: disable=protected-access
    graphs = [concrete.graph] + [f.graph for f in concrete.graph._functions.values()  # pylint: disable=protected-access
                                 if hasattr(f, "graph")]
    for graph in graphs:
      found += [f"{op.name}:{op.get_attr('T').name}" for op in graph.get_operations()
                if op.type.startswith("CollectiveReduce")]
  return found


def _os_threads():
  """This process's threads, as the kernel counts them (TF's C++ threads included)."""
  with open("/proc/self/status", encoding="utf-8") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("Threads:"))


def flat(variables):
  return np.concatenate([np.asarray(v).astype("float64").ravel() for v in variables])


class StallAt(keras.callbacks.Callback):
  """Worker 0 stops calling collectives after step `step` (it sleeps), so the others wait alone."""

  def __init__(self, worker, step):
    super().__init__()
    self.worker, self.step = worker, step

  def on_train_batch_end(self, batch, logs=None):
    if self.worker == 0 and int(self.model.optimizer.iterations.numpy()) == self.step:
      print(f"GRADIENT stalled worker=0 step={self.step}", flush=True)
      time.sleep(120)


def fit(model, worker, overflow=False, callbacks=()):
  ds = dataset(*data(worker, overflow))
  model.fit(ds, epochs=1, verbose=0, callbacks=list(callbacks))
  return model


def main(out_dir, cases):
  if "stall" in cases:
    tfdp.configure_gradients(timeout_seconds=STALL_TIMEOUT)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  worker = strategy.cluster_resolver.task_id
  tf.config.experimental.enable_op_determinism()
  print(f"GRADIENT compat {','.join(sorted(tfdp.compat.applied()))}", flush=True)
  for case in cases.split(","):
    result = {}
    if case == "f16":
      model = fit(build(strategy, "mixed_float16"), worker, overflow=worker == 1)
      result.update(scale=float(model.optimizer.dynamic_scale.numpy()))
    elif case == "buckets":
      tfdp.configure_gradients(bucket_cap_mb=0.004, first_bucket_mb=0.001)
      model = fit(build(strategy), worker)
      result.update(bucketed=flat(model.weights), bucketed_ops=np.array(all_reduces(model)))
      tfdp.configure_gradients(bucket_cap_mb=0)
      model = fit(build(strategy), worker)
    elif case == "bf16":
      tfdp.configure_gradients(compression="bf16")
      model = fit(build(strategy), worker)
    elif case == "parity":
      model = None
      result.update({f"{name}/{field}": value
                     for name, run in gradient_parity.run_all(strategy).items()
                     for field, value in run.items()})
    elif case == "stall":
      model = fit(build(strategy), worker, callbacks=[StallAt(worker, STALL_AT)])
      raise AssertionError("the stalled fit returned")
    else:
      raise ValueError(f"unknown case {case!r}")
    if model is not None:
      result.update(weights=flat(model.weights), steps=int(model.optimizer.iterations.numpy()),
                    ops=np.array(all_reduces(model)))
    result["threads"] = _os_threads()
    np.savez(os.path.join(out_dir, f"{case}-{worker}.npz"), **result)
    tfdp.gradients.settings.reset()
    print(f"GRADIENT {case} done worker={worker}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
