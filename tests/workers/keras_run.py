"""A user's whole Keras run, converted to tfdp as the README says: a CNN on a tf.data pipeline, fit with Keras's own callbacks.

Usage: keras_run.py OUT_DIR. The script (issue 29's shape, small): 8x8 images
through a tf.data pipeline (shuffle, batch, prefetch); a CNN with
RandomFlip and Dropout; fit(validation_data=..., epochs=5, verbose=2) with
TensorBoard, ModelCheckpoint(save_best_only=True), EarlyStopping(patience=3,
which stops it after 4 epochs), CSVLogger and
tfdp.callbacks.BackupAndRestore(save_freq=20, local_checkpoint_every_steps=
"auto"); then model.save. Op determinism on; 10 steps an epoch.

Env:
  TFDP_TEST_KILL=STEP:WHERE  worker 1 SIGKILLs itself at global step STEP:
      WHERE=batch at that step's batch end (before its backups), or
      WHERE=validation as the validation after that step begins (after the
      step's local save, which both workers wait for, up to 10 s).
  TFDP_TEST_BF16=1  after fit, the mixed_bfloat16 predict and evaluate cell
      (tests/test_mixed_bf16.py): prints `BF16 worker=i {json}`.

What each process did goes to OUT_DIR/records/worker<i>-<pid>.jsonl, a JSON
object a line: {"epoch", "logs", "early_stopping"} at every epoch end, and
{"wrote": path} for every file under OUT_DIR (but backup/ and records/)
that it opened for writing (a Python audit hook, so TensorFlow's C++ writers
are left out: TensorBoard names its event files with the writer's pid).
"""

import json
import os
import signal
import sys
import time

import tfdp

strategy = tfdp.make_strategy()  # first: before any tf.data dataset or model

import keras  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 16, 10, 5
WORKER = int(os.environ.get("TFDP_WORKER_INDEX", "0"))


class Records:
  """This process's JSON lines, flushed as they come (a SIGKILL loses none)."""

  def __init__(self, out):
    folder = os.path.join(out, "records")
    os.makedirs(folder, exist_ok=True)
    self.out = os.path.abspath(out)
    self.skip = (os.path.join(self.out, "backup"), folder)
    self.file = open(os.path.join(folder, f"worker{WORKER}-{os.getpid()}.jsonl"), "a",
                     encoding="utf-8")
    self.write({"pid": os.getpid(), "worker": WORKER})
    sys.addaudithook(self.audit)

  def write(self, record):
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()

  def audit(self, event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
      return
    path, mode, flags = args
    writing = (mode and any(c in mode for c in "wax+")) or (
        flags and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    path = os.path.abspath(os.fsdecode(path))
    if writing and path.startswith(self.out + os.sep) and not path.startswith(self.skip):
      self.write({"wrote": os.path.relpath(path, self.out)})


class Recorder(keras.callbacks.Callback):
  """Each epoch's logs and EarlyStopping's state, as this worker saw them at the epoch's end."""

  def __init__(self, records, stop):
    super().__init__()
    self.records, self.stop = records, stop

  def on_epoch_end(self, epoch, logs=None):
    self.records.write({"epoch": epoch, "logs": dict(logs or {}), "early_stopping": {
        k: getattr(self.stop, k) for k in ("wait", "best", "best_epoch", "stopped_epoch")}})


class KillWorker1(keras.callbacks.Callback):
  """TFDP_TEST_KILL: worker 1 SIGKILLs itself at a step, at its batch end or as its validation begins."""

  def __init__(self, spec, backup, out):
    super().__init__()
    step, self.where = spec.split(":")
    self.step, self.backup, self.out = int(step), backup, out

  def _step(self):
    return int(self.model.optimizer.iterations.numpy())

  def on_train_batch_end(self, batch, logs=None):
    if self.where == "batch" and self._step() == self.step and WORKER == 1:
      os.kill(os.getpid(), signal.SIGKILL)

  def on_test_begin(self, logs=None):
    if self.where != "validation" or self._step() != self.step:
      return
    # The step's local save is made: wait until it is committed here, then
    # worker 0 says so and worker 1 dies.
    marker = os.path.join(self.out, "records", f"local-{self.step}-worker0")
    deadline = time.monotonic() + 60  # a busy host; committed in well under 1 s alone
    while time.monotonic() < deadline and not any(
        p.rstrip("/").endswith(f"-{self.step}") for p in self.backup.manager.local_checkpoints()):
      time.sleep(0.05)
    if WORKER == 0:
      open(marker, "w", encoding="utf-8").close()
      return
    while time.monotonic() < deadline and not os.path.exists(marker):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def datasets():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(GLOBAL_BATCH * STEPS_PER_EPOCH + 32, 8, 8, 3)).astype("float32")
  labels = (images[..., 0].mean(axis=(1, 2)) > 0).astype("int32") + 2 * (
      images[..., 1].mean(axis=(1, 2)) > 0).astype("int32")
  train = (tf.data.Dataset.from_tensor_slices((images[32:], labels[32:]))
           .shuffle(GLOBAL_BATCH * STEPS_PER_EPOCH, seed=1).batch(GLOBAL_BATCH).prefetch(2))
  val = tf.data.Dataset.from_tensor_slices((images[:32], labels[:32])).batch(GLOBAL_BATCH)
  return train, val


def make_model():
  model = keras.Sequential([
      keras.Input((8, 8, 3)), keras.layers.RandomFlip("horizontal", seed=1),
      keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dropout(0.1, seed=2), keras.layers.Dense(4)])
  model.compile(keras.optimizers.Adam(1e-2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model


def bf16_cell(val):
  """mixed_bfloat16 predict and evaluate under this strategy; predict against the model called on all rows at once."""
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    x = np.concatenate([b[0].numpy() for b in val])
    with strategy.scope():
      model = make_model()
    result = {}
    try:
      predicted = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
      result.update(predict_dtype=str(predicted.dtype), predict_shape=list(predicted.shape),
                    predict_max_error=float(np.max(np.abs(
                        np.asarray(predicted, "float32")
                        - np.asarray(model(x, training=False), "float32")))))
    except Exception as e:  # pylint: disable=broad-except
      result["predict_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    result["evaluate"] = model.evaluate(val, verbose=0)
    print(f"BF16 worker={WORKER} {json.dumps(result)}", flush=True)
  finally:
    keras.config.set_dtype_policy("float32")


def main(out):
  records = Records(out)
  tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(1)
  train, val = datasets()
  with strategy.scope():
    model = make_model()
  stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=100)
  backup = tfdp.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=20,
                                           local_checkpoint_every_steps="auto")
  callbacks = [keras.callbacks.TensorBoard(os.path.join(out, "tb")),
               keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras"),
                                               save_best_only=True),
               stop, keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
               Recorder(records, stop), backup]
  if os.environ.get("TFDP_TEST_KILL"):
    callbacks.insert(0, KillWorker1(os.environ["TFDP_TEST_KILL"], backup, out))
  model.fit(train, validation_data=val, epochs=EPOCHS, callbacks=callbacks, verbose=2)
  model.save(os.path.join(out, "final.keras"))
  print(f"DONE worker={WORKER} step={int(model.optimizer.iterations.numpy())}", flush=True)
  if os.environ.get("TFDP_TEST_BF16") == "1":
    bf16_cell(val)


if __name__ == "__main__":
  main(sys.argv[1])
