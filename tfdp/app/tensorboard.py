"""TensorBoard keyed by the global step: a `keras.callbacks.TensorBoard` whose points survive resumes, one per step."""

import time

import keras
import tensorflow as tf

from tfdp import errors
from tfdp.app.timings import Timings
from tfdp.checkpoint.schedule import policy
from tfdp.resume import train_state as state_lib


class TensorBoard(keras.callbacks.TensorBoard):
  """`keras.callbacks.TensorBoard` whose summaries are keyed by the global step.

  Keras's callback counts batches of each `fit` call and epochs; here every
  batch and epoch summary is written at the optimizer's iteration count,
  which survives resumes: a run restored at step 600 writes its first batch
  point at 601, and an epoch interrupted and resumed gets its point at the
  step that ends it (`epoch_*` at global steps, not epoch numbers). When a
  run starts writing it marks the event file with a `SessionLog.START` at
  its first step, which makes TensorBoard drop the points an interrupted
  earlier run wrote past the checkpoint this run resumed from, so the
  curve has one point per step. Writers stay open across the `fit` calls of
  `tfdp.fit` (call `close()` at the end; `on_train_end` flushes).

  Write it from the chief only: every process writes its own event file,
  and two files of the same steps in one directory overlap in TensorBoard.
  `tfdp-train` adds it on the chief only.

  Extra scalars: `batch_examples_per_second` and `epoch_examples_per_second`
  (examples over the wall time since the previous point, evaluation time
  excluded, checkpoint time included), `checkpoint_seconds` at each step
  that saved (the time the step was blocked in the save, measured by a
  `CheckpointTimer` sharing `timings`), and, through `write_eval`, the
  evaluation metrics `val_*` in the `validation` run.

  Args:
    log_dir: as Keras's (`train/` and `validation/` below it).
    global_batch_size: examples per step (for examples/s; None: not written).
    update_freq: "epoch", "batch" or N: batch summaries every N global steps.
    timings: the run's `Timings` (evaluation and checkpoint time).
    **kwargs: other arguments of `keras.callbacks.TensorBoard`.
  """

  def __init__(self, log_dir: str = "logs", *, global_batch_size: int | None = None,
               update_freq: str | int = "epoch", timings: Timings | None = None,
               **kwargs):
    # Keras writes steps/s at its own batch count; this class writes it (and
    # examples/s) at the global step instead.
    self._write_rate = bool(kwargs.pop("write_steps_per_second", False))
    super().__init__(log_dir, update_freq=update_freq, **kwargs)
    if self.update_freq != "epoch" and (
        isinstance(self.update_freq, bool) or not isinstance(self.update_freq, int)
        or self.update_freq < 1):
      raise errors.ConfigError(
          f"update_freq={update_freq!r}: pass 'epoch', 'batch' or a number of steps >= 1.")
    self.global_batch_size = global_batch_size
    self.timings = timings or Timings()
    self._cadence = policy.Cadence(
        *(() if self.update_freq == "epoch" else (policy.EveryNSteps(self.update_freq),)))
    self.first_step = None  # The step this process started writing at.
    self._started = set()  # Writers marked with SessionLog.START.
    self._mark = None  # (step, time, eval seconds) of the last throughput point.
    self._epoch_mark = None
    self._saves_written = 0
    self._training = False

  # --- writers -------------------------------------------------------------

  def set_model(self, model):
    # Keras resets its writers (a new event file) in every fit call; tfdp.fit
    # makes several per run, and they must share one file.
    if model is getattr(self, "_model", None) and self._writers:
      self._model = model
      return
    super().set_model(model)

  def _writer(self, name):
    writer = self._train_writer if name == "train" else self._val_writer
    if name not in self._started and self.first_step is not None:
      self._started.add(name)
      _write_session_start(writer, self.first_step + 1)
    return writer

  def flush(self):
    """Writes buffered events to disk."""
    for writer in self._writers.values():
      writer.flush()

  def close(self):
    """Flushes and closes the event files (the end of a run)."""
    self._close_writers()
    self._writers = {}
    self._started = set()

  def _push_writer(self, writer, step):
    # Summaries written inside the model get the global step of the batch
    # being run, not Keras's count of batches of this fit call.
    del step
    if self.update_freq == "epoch":
      return
    step = state_lib.global_step(self.model) + (1 if self._training else 0)
    super()._push_writer(writer, step)

  # --- training --------------------------------------------------------------

  def on_train_begin(self, logs=None):
    self._training = True
    super().on_train_begin(logs)

  def on_train_end(self, logs=None):
    self._training = False
    self._pop_writer()
    if self._is_tracing:
      self._stop_trace()
    self.flush()

  def on_train_batch_begin(self, batch, logs=None):
    if self.first_step is None:
      # Not in on_train_begin: a BackupAndRestore listed after this callback
      # restores there, and the first step must be the restored one.
      self.first_step = state_lib.global_step(self.model)
      self._writer("train")  # Marks the file with the first step at once.
    if self._mark is None:
      self._mark = (self.first_step, time.perf_counter(), self.timings.eval_seconds)
      self._cadence.start(self.first_step)
    super().on_train_batch_begin(batch, logs)

  def on_train_batch_end(self, batch, logs=None):
    # Keras's method, minus its scalars (written at its own batch count):
    # the train graph and the profiler's trace.
    super().on_train_batch_end(batch, None)
    step = state_lib.global_step(self.model)
    self.write_saves()
    if not self._cadence.due(step):
      return
    scalars = {}
    if isinstance(logs, dict):
      scalars.update({f"batch_{k}": v for k, v in logs.items()})
    scalars.update(self._rates("batch_", step, "_mark"))
    with self._writer("train").as_default():
      for name, value in scalars.items():
        tf.summary.scalar(name, value, step=step)

  def on_test_begin(self, logs=None):
    self._writer("validation")
    super().on_test_begin(logs)

  def on_epoch_begin(self, epoch, logs=None):
    super().on_epoch_begin(epoch, logs)
    self._epoch_mark = (state_lib.global_step(self.model), time.perf_counter(),
                        self.timings.eval_seconds)

  def on_epoch_end(self, epoch, logs=None):
    step = state_lib.global_step(self.model)
    logs = dict(logs or {})
    train = {k: v for k, v in logs.items() if not k.startswith("val_")}
    val = {k[len("val_"):]: v for k, v in logs.items() if k.startswith("val_")}
    train = self._collect_learning_rate(train)
    train.update({k[len("epoch_"):]: v for k, v in self._rates("epoch_", step, "_epoch_mark").items()})
    if train:
      with self._writer("train").as_default():
        for name, value in train.items():
          tf.summary.scalar(f"epoch_{name}", value, step=step)
    if val:
      with self._writer("validation").as_default():
        for name, value in val.items():
          tf.summary.scalar(f"epoch_{name}", value, step=step)
    if self.histogram_freq and epoch % self.histogram_freq == 0:
      self._log_weights(step)
    if self.embeddings_freq and epoch % self.embeddings_freq == 0:
      self._log_embeddings(epoch)

  def _rates(self, prefix, step, mark_name):
    """examples/s (and steps/s if asked) since the mark `mark_name`, which moves to now."""
    mark = getattr(self, mark_name)
    now = time.perf_counter()
    setattr(self, mark_name, (step, now, self.timings.eval_seconds))
    if mark is None:
      return {}
    steps = step - mark[0]
    seconds = (now - mark[1]) - (self.timings.eval_seconds - mark[2])
    if steps <= 0 or seconds <= 0:
      return {}
    out = {}
    if self.global_batch_size:
      out[f"{prefix}examples_per_second"] = steps * self.global_batch_size / seconds
    if self._write_rate:
      out[f"{prefix}steps_per_second"] = steps / seconds
    return out

  def write_saves(self) -> None:
    """Writes `checkpoint_seconds` of the saves in `timings` not written yet."""
    saves = self.timings.saves[self._saves_written:]
    if not saves:
      return
    self._saves_written = len(self.timings.saves)
    with self._writer("train").as_default():
      for step, seconds in saves:
        tf.summary.scalar("checkpoint_seconds", seconds, step=step)

  def write_eval(self, step: int, metrics: dict) -> None:
    """Writes evaluation `metrics` (names such as `val_loss`) at global `step` in `validation/`."""
    if self.first_step is None:
      self.first_step = step
    with self._writer("validation").as_default():
      for name, value in metrics.items():
        tf.summary.scalar(name, value, step=step)


def _write_session_start(writer, step):
  """Marks `writer`'s event file with SessionLog.START at `step`.

  TensorBoard's loaders then discard the events earlier files hold at steps
  >= `step`: what a run killed after its last checkpoint wrote beyond it,
  which the resumed run writes again.
  """
  # TF 2's summary API writes no SessionLog; ImportEvent is its op for
  # writing a whole Event into a writer.
  from tensorflow.python.ops import summary_ops_v2  # pylint: disable=g-import-not-at-top
  event = tf.compat.v1.Event(step=step, wall_time=time.time(),
                             session_log=tf.compat.v1.SessionLog(
                                 status=tf.compat.v1.SessionLog.START))
  with writer.as_default():
    summary_ops_v2.import_event(tf.constant(event.SerializeToString()))
