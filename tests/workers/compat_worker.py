"""Worker of tests/test_compat.py: Keras fit/evaluate/predict under a real MultiWorkerMirroredStrategy.

Usage (one process per worker, each with its TF_CONFIG, e.g. through
`python -m tfdp.launch --num_workers=2 --`):

  compat_worker.py OUT_DIR PART[,PART...]

Parts, run in order in one process (one strategy; each part makes its own
model, so a fix reverted before a part does not act on the others'):
  seq    a Dense model, steps_per_execution=1: fit (4 steps x 2 epochs),
         evaluate and predict on 70 rows (a partial last batch); the same fit
         without a strategy from the same initial weights is the reference.
  multi  a model with dict inputs, two outputs and BatchNormalization,
         steps_per_execution=2: fit, evaluate, predict with Keras's default
         verbose, then evaluate with verbose=2, between the lines "BEGIN
         verbose" and "END verbose" (what each worker prints).
  PROBE:FIX
         with the fix FIX disabled (TFDP_COMPAT_DISABLE, then compat.apply()),
         the smallest fit that shows it is needed; PROBE is probe_fit
         (steps_per_execution=1), probe_spe (=2) or probe_bn (with
         BatchNormalization). Its error, if any, is kept as `error_FIX`, the
         fixes applied as `applied_FIX`, its weights as `FIX_w<i>`; then every
         fix is applied again. A probe that fails inside a step function
         (probe_spe) may leave the collectives unusable: put it last.

After each part each worker writes OUT_DIR/worker<i>.npz (everything so far).
"""

import faulthandler
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf
import keras

from tfdp import cluster
from tfdp import compat

# A worker stuck in a collective after its peer died must not hang the test.
faulthandler.dump_traceback_later(420, exit=True)

FIT_ROWS = 64  # 4 global batches of 16: every replica gets 8 rows.
EVAL_ROWS = 70  # the last batch of 6 is split across the workers.
BATCH = 16
EPOCHS = 2


def _data(rows):
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, size=(rows, 4)).astype("float32")
  y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.25)
  return x, y


def _dense_model():
  return keras.Sequential([
      keras.Input((4,)),
      keras.layers.Dense(8, activation="tanh"),
      keras.layers.Dense(1),
  ])


def _compile(model, steps_per_execution=1, **kwargs):
  model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False,
                steps_per_execution=steps_per_execution, **kwargs)


def run_seq(strategy, out):
  """Dense model, steps_per_execution=1, checked against a no-strategy run."""
  x, y = _data(FIT_ROWS)
  xe, ye = _data(EVAL_ROWS)
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = _dense_model()
    _compile(model, loss="mse", metrics=["mae"])
  initial = model.get_weights()
  history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                      verbose=0)
  out["seq_loss"] = np.array(history.history["loss"])
  out["seq_eval"] = np.array(model.evaluate(xe, ye, batch_size=BATCH,
                                            verbose=0))
  out["seq_pred"] = model.predict(xe, batch_size=BATCH, verbose=0)
  out["seq_direct"] = model(xe).numpy()
  for i, w in enumerate(model.get_weights()):
    out[f"seq_w{i}"] = w

  # The same training without a strategy: one replica, global batches of 16.
  reference = _dense_model()
  reference.set_weights(initial)
  _compile(reference, loss="mse", metrics=["mae"])
  reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                verbose=0)
  out["seq_ref_eval"] = np.array(reference.evaluate(xe, ye, batch_size=BATCH,
                                                    verbose=0))
  for i, w in enumerate(reference.get_weights()):
    out[f"seq_ref_w{i}"] = w


def run_multi(strategy, out):
  """Dict inputs, two outputs, BatchNormalization, steps_per_execution=2; progress bars as asked.

  fit, evaluate and predict run with Keras's default verbose ("auto"), then
  evaluate with verbose=2: their progress bars are the section "verbose"
  (one run serves both, as the bars do not depend on the model).
  """
  x, y = _data(FIT_ROWS)
  xe, ye = _data(EVAL_ROWS)

  def inputs(x):
    return {"a": x, "b": x[:, :2] * x[:, 2:]}

  def targets(x, y):
    return {"y": y, "z": x[:, 1:3]}

  keras.utils.set_random_seed(2)
  with strategy.scope():
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="relu")(a)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Concatenate()([h, b])
    model = keras.Model({"a": a, "b": b}, {
        "y": keras.layers.Dense(1, name="y")(h),
        "z": keras.layers.Dense(2, name="z")(h),
    })
    _compile(model, steps_per_execution=2, loss={"y": "mse", "z": "mse"},
             metrics={"y": ["mae"]})
  print("BEGIN verbose", flush=True)
  history = model.fit(inputs(x), targets(x, y), batch_size=BATCH,
                      epochs=1, shuffle=False)
  out["multi_loss"] = np.array(history.history["loss"])
  logs = model.evaluate(inputs(xe), targets(xe, ye), batch_size=BATCH,
                        return_dict=True)
  for k, v in logs.items():
    out[f"multi_eval_{k}"] = np.array(v)
  pred = model.predict(inputs(xe), batch_size=BATCH)
  # Asked for explicitly: still the chief's only (unless TFDP_PROGRESS_ALL_WORKERS=1).
  model.evaluate(inputs(xe), targets(xe, ye), batch_size=BATCH, verbose=2)
  sys.stdout.flush()
  print("END verbose", flush=True)
  direct = model(inputs(xe))
  for k in ("y", "z"):
    out[f"multi_pred_{k}"] = pred[k]
    out[f"multi_direct_{k}"] = direct[k].numpy()
  for i, w in enumerate(model.get_weights()):
    out[f"multi_w{i}"] = w
  bn = next(l for l in model.layers
            if isinstance(l, keras.layers.BatchNormalization))
  out["multi_bn_moving_mean"] = bn.moving_mean.numpy()
  out["multi_bn_moving_variance"] = bn.moving_variance.numpy()


def _probe_fit(strategy, out, prefix, steps_per_execution, batch_norm=False):
  """The smallest fit that shows one fix is needed: 1 epoch of 4 steps."""
  x, y = _data(FIT_ROWS)
  with strategy.scope():
    layers = [keras.Input((4,)), keras.layers.Dense(4)]
    if batch_norm:
      layers.append(keras.layers.BatchNormalization())
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    _compile(model, steps_per_execution=steps_per_execution, loss="mse")
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  for i, w in enumerate(model.get_weights()):
    out[f"{prefix}_w{i}"] = w


PROBES = {
    "probe_fit": lambda s, out, prefix: _probe_fit(s, out, prefix, 1),
    "probe_spe": lambda s, out, prefix: _probe_fit(s, out, prefix, 2),
    "probe_bn": lambda s, out, prefix: _probe_fit(s, out, prefix, 1, batch_norm=True),
}


def run_without(strategy, out, probe, fix):
  """Runs `probe` with `fix` disabled in this process, then applies every fix again."""
  compat.revert()
  os.environ[compat.DISABLE_ENV] = fix
  try:
    out[f"applied_{fix}"] = np.array(sorted(compat.apply()))
    print(f"without {fix}: compat fixes applied:", sorted(compat.applied()), flush=True)
    try:
      PROBES[probe](strategy, out, fix)
    except Exception as e:  # pylint: disable=broad-except
      out[f"error_{fix}"] = np.array(f"{type(e).__name__}: {e}")
      print(f"without {fix}: {type(e).__name__}", flush=True)
  finally:
    del os.environ[compat.DISABLE_ENV]
    compat.revert()
    compat.apply()


PARTS = {
    "seq": run_seq,
    "multi": run_multi,
}


def main(argv):
  out_dir, parts = argv[1], argv[2].split(",")
  compat.apply()  # Idempotent; `import tfdp` already did it.
  print("compat fixes applied:", sorted(compat.applied()), flush=True)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  tf.config.threading.set_intra_op_parallelism_threads(1)
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation
          .RING))
  task = cluster.resolve(strategy).index
  out = {}
  for part in parts:
    if ":" in part:
      run_without(strategy, out, *part.split(":"))
    else:
      PARTS[part](strategy, out)
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), **out)
    print(f"part {part} done", flush=True)


if __name__ == "__main__":
  main(sys.argv)
