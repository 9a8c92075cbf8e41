"""Worker of tests/test_keras_matrix.py: the cells of the Keras fit matrix, several in one process.

Usage: matrix_worker.py OUT_ROOT CELL[,CELL...] [CPU_REPLICAS]

Each CELL is `name:strategy:input:steps_per_execution:option+option`
(options may be empty). Strategies: `none` (no strategy), `own` (the user's
own `tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])`), `tfdp`
(`tfdp.make_strategy("mirrored", cpu_replicas=2)`), `multi_worker` (under
TF_CONFIG: the user's own `tf.distribute.MultiWorkerMirroredStrategy()`, or
with CPU_REPLICAS 2 `tfdp.make_strategy(cpu_replicas=2)`). Inputs: `repeat`
(a repeated dataset with steps_per_epoch), `finite` (a dataset), `arrays`.
Options: `val` (validation_data, validation_freq=2), `cw` (class_weight),
`bf16` (the mixed_bfloat16 policy, logits in bfloat16 too, so that `predict`
gathers bfloat16 outputs), `f16` (the mixed_float16 policy: Keras wraps the
optimizer in a LossScaleOptimizer; logits in float32), `clip` (the optimizer
clips the global norm of the gradients at 0.1), `gc16`
(tfdp.configure_gradients(compression="bf16") for the cell: bfloat16
gradient all-reduces), `rand` (RandomFlip, RandomTranslation and Dropout in
the model), `twin` (no strategy and no backup: the single-device run of the
cell's configuration).

Every cell is the same ordinary Keras script (a small conv net, AdamW with a
cosine schedule and weight decay, op determinism on) with tfdp.callbacks.BackupAndRestore
(save_freq=5) in place of Keras's, in OUT_ROOT/NAME/backup: fit (3 epochs of
10 steps; 12 with `repeat` and steps_per_execution 3, as Keras runs whole
executions), evaluate, predict; it writes OUT_ROOT/NAME/result-<worker>.npz.
The cells run one after the other. With TFDP_MATRIX_PAUSE=1 a cell that
restored nothing stops mid epoch 2 (see PauseAt) and runs the next cell
there, inside its callback; the last one prints `MATRIX PAUSED pid=<pid>
worker=<i>` and waits to be SIGKILLed. So one kill leaves every cell of the
process mid-epoch with a backup, and the same command run again resumes each
of them.
"""

import dataclasses
import os
import sys
import time
import zlib

import keras
import numpy as np
import tensorflow as tf
import tfdp

BATCH = 16
EPOCHS = 3
STEPS_PER_EPOCH = 10
ROWS = BATCH * STEPS_PER_EPOCH  # finite and arrays: one pass is one epoch
REPEAT_ROWS = 128  # repeat: 8 batches, so epochs straddle passes
EVAL_ROWS = 48
SAVE_FREQ = 5  # not a multiple of steps_per_execution 3
CLASS_WEIGHT = {0: 1.0, 1: 2.0, 2: 0.5}
PAUSE_ENV = "TFDP_MATRIX_PAUSE"


@dataclasses.dataclass(frozen=True)
class Cell:
  """One cell of the matrix."""
  name: str
  strategy: str
  input: str
  spe: int
  options: frozenset

  @classmethod
  def parse(cls, spec):
    name, strategy, kind, spe, options = spec.split(":")
    return cls(name, strategy, kind, int(spe), frozenset(o for o in options.split("+") if o))


def data(rows, seed):
  """Images (rows, 8, 8, 1) and labels in {0, 1, 2} that depend on them."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 8, 8, 1)).astype("float32")
  score = x[:, :4].mean(axis=(1, 2, 3)) - x[:, 4:].mean(axis=(1, 2, 3))
  y = np.digitize(score, [-0.1, 0.1]).astype("int32")
  return x, y


def dataset(x, y, repeat=False):
  ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=5).batch(BATCH)
  return (ds.repeat() if repeat else ds).prefetch(2)


POLICIES = {"bf16": "mixed_bfloat16", "f16": "mixed_float16"}


def build_model(cell):
  """The user's model: a mixed precision policy is global, set while the model is built."""
  policy = next((POLICIES[o] for o in sorted(cell.options) if o in POLICIES), "float32")
  keras.mixed_precision.set_global_policy(policy)
  try:
    inputs = keras.Input((8, 8, 1))
    h = inputs
    if "rand" in cell.options:
      h = keras.layers.RandomFlip("horizontal", seed=11)(h)
      h = keras.layers.RandomTranslation(0.2, 0.2, seed=12)(h)
    h = keras.layers.Conv2D(4, 3, activation="relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    if "rand" in cell.options:
      h = keras.layers.Dropout(0.2, seed=13)(h)
    # Logits in float32, as Keras's mixed precision guide says; in bfloat16
    # for `bf16`, as a user who skipped that advice has them.
    outputs = keras.layers.Dense(3, dtype=None if "bf16" in cell.options else "float32")(h)
    return keras.Model(inputs, outputs)
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _flat(variables):
  return np.concatenate([np.asarray(v).astype("float64").ravel() for v in variables])


class PauseAt(keras.callbacks.Callback):
  """Stops a cell that restored nothing mid epoch 2, at the first step after a backup of that epoch.

  At that step (after its callbacks, the backup's included) it runs `then`:
  the next cell, or the wait for SIGKILL. The backup is at a step of the
  same epoch (not its first), and not at the step it stops at, so the
  resumed run redoes steps from a mid-epoch data position.
  """

  def __init__(self, cell, backup, then):
    super().__init__()
    self.cell, self.backup, self.then = cell, backup, then
    self.epoch, self.epoch_start = None, None

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch, self.epoch_start = epoch, int(self.model.optimizer.iterations.numpy())

  def on_train_batch_end(self, batch, logs=None):
    step = int(self.model.optimizer.iterations.numpy())
    saved = self.backup.manager.last_saved_step
    if (self.epoch != 1 or self.backup.restored_step is not None or saved is None
        or not self.epoch_start < saved < step):
      return
    print(f"MATRIX {self.cell.name} paused at step {step} saved={saved}", flush=True)
    self.then()


class Run:
  """The cells of one process, their strategies (made once each) and this worker's index."""

  def __init__(self, out_root, cells, cpu_replicas):
    self.out_root, self.cells, self.cpu_replicas = out_root, cells, cpu_replicas
    self.pause = os.environ.get(PAUSE_ENV) == "1"
    self._strategies = {}
    self.worker = tfdp.cluster.resolve(self.strategy(cells[0])).index

  def strategy(self, cell):
    kind = "none" if "twin" in cell.options else cell.strategy
    if kind not in self._strategies:
      if kind == "none":
        made = tf.distribute.get_strategy()
      elif kind == "own":
        made = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
      elif kind == "tfdp":
        made = tfdp.make_strategy("mirrored", cpu_replicas=2)
      elif self.cpu_replicas > 1:
        made = tfdp.make_strategy(cpu_replicas=self.cpu_replicas)
      else:
        made = tf.distribute.MultiWorkerMirroredStrategy()
      self._strategies[kind] = made
    return self._strategies[kind]

  def cell(self, i):
    """Runs cell i (and, when paused there, the next ones inside it)."""
    cell = self.cells[i]
    out_dir = os.path.join(self.out_root, cell.name)
    os.makedirs(out_dir, exist_ok=True)
    strategy = self.strategy(cell)
    # A twin starts from its cell's weights: the seed comes from the cell's name.
    keras.utils.set_random_seed(zlib.crc32(cell.name.split("@")[0].encode()) % 10_000)
    x, y = data(REPEAT_ROWS if cell.input == "repeat" else ROWS, seed=1)
    xe, ye = data(EVAL_ROWS, seed=2)
    with strategy.scope():
      model = build_model(cell)
      schedule = keras.optimizers.schedules.CosineDecay(0.01, EPOCHS * STEPS_PER_EPOCH)
      initial = _flat(model.weights)
      clip = {"global_clipnorm": 0.1} if "clip" in cell.options else {}
      model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, **clip),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"], steps_per_execution=cell.spe)
    kwargs, callbacks, backup = {}, [], None
    if "twin" not in cell.options:
      backup = tfdp.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"),
                                               save_freq=SAVE_FREQ)
      callbacks = [backup]
      if self.pause:
        callbacks.append(PauseAt(cell, backup, lambda: self.after(i)))
    if "val" in cell.options:
      xv, yv = data(2 * BATCH, seed=3)
      kwargs.update(validation_freq=2, validation_data=(
          (xv, yv) if cell.input == "arrays" else dataset(xv, yv)))
    if "cw" in cell.options:
      kwargs["class_weight"] = CLASS_WEIGHT
    tfdp.configure_gradients(compression="bf16" if "gc16" in cell.options else None)
    if cell.input == "arrays":
      history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks,
                          verbose=0, **kwargs)
      evaluated = model.evaluate(xe, ye, batch_size=BATCH, verbose=0, return_dict=True)
      predicted = model.predict(xe, batch_size=BATCH, verbose=0)
    else:
      if cell.input == "repeat":
        kwargs["steps_per_epoch"] = STEPS_PER_EPOCH
      history = model.fit(dataset(x, y, repeat=cell.input == "repeat"), epochs=EPOCHS,
                          callbacks=callbacks, verbose=0, **kwargs)
      evaluated = model.evaluate(tf.data.Dataset.from_tensor_slices((xe, ye)).batch(BATCH),
                                 verbose=0, return_dict=True)
      predicted = model.predict(tf.data.Dataset.from_tensor_slices(xe).batch(BATCH), verbose=0)
    result = {
        "initial": initial,
        "weights": _flat(model.weights),
        "optimizer": _flat(model.optimizer.variables),
        "predicted": np.asarray(predicted, dtype="float32"),
        "predicted_dtype": np.array(str(predicted.dtype)),
        "direct": np.asarray(model(xe, training=False), dtype="float32"),
        "steps": int(model.optimizer.iterations.numpy()),
        "restored": -1 if backup is None or backup.restored_step is None else backup.restored_step,
        "history_keys": np.array(sorted(history.history)),
        "val_epochs": np.array(len(history.history.get("val_loss", []))),
    }
    result.update({f"eval_{k}": np.asarray(v) for k, v in evaluated.items()})
    np.savez(os.path.join(out_dir, f"result-{self.worker}.npz"), **result)
    print(f"MATRIX {cell.name} done worker={self.worker} steps={result['steps']} "
          f"restored={result['restored']}", flush=True)

  def after(self, i):
    """At cell i's kill step: the next cell, or (the last) announce and wait for SIGKILL."""
    if i + 1 < len(self.cells):
      self.cell(i + 1)
      raise AssertionError("a paused cell returned")
    print(f"MATRIX PAUSED pid={os.getpid()} worker={self.worker}", flush=True)
    time.sleep(600)
    raise AssertionError("not killed")


def main(out_root, cells, cpu_replicas="1"):
  cells = [Cell.parse(spec) for spec in cells.split(",")]
  if any(c.strategy in ("own", "tfdp") for c in cells):
    # What a user does for a MirroredStrategy over 2 CPUs (make_strategy
    # does the same and finds it done).
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration() for _ in range(2)])
  run = Run(out_root, cells, int(cpu_replicas))
  tf.config.experimental.enable_op_determinism()
  if run.pause:
    run.cell(0)
    raise AssertionError(f"cell {cells[0].name} ended without pausing")
  for i in range(len(cells)):
    run.cell(i)


if __name__ == "__main__":
  main(*sys.argv[1:])
