"""What a run reports: periodic evaluation and the end-of-run summary; TensorBoard and the timings are re-exported (`tfdp.summaries`)."""

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

from absl import logging
import keras

from tfdp import errors
from tfdp.app.tensorboard import TensorBoard
from tfdp.app.timings import CheckpointTimer
from tfdp.app.timings import Timings
from tfdp.checkpoint.schedule import policy
from tfdp.resume import train_state as state_lib

# The public names of `tfdp.summaries`, wherever they are defined.
__all__ = ["CheckpointTimer", "Evaluate", "RunSummary", "TensorBoard", "Timings",
           "format_metrics"]


class Evaluate(keras.callbacks.Callback):
  """Evaluates the model every `every_n_steps` global steps and at `train_steps`, distributed.

  `model.evaluate` runs under the model's strategy on the dataset
  `make_dataset()` returns (e.g. a `tfdp.data.distribute` of a held-out
  split), for `steps` batches from its start, so every evaluation sees the
  same examples. Every worker must run it (evaluation uses collectives).
  Metrics are named `val_<metric>` and passed to each of `on_metrics`
  (`fn(step, metrics)`), e.g. `TensorBoard.write_eval` and
  `BackupAndRestore.note_metrics`; list this callback before the
  checkpoint callback so a save at the same step carries them. The
  training metrics' running state is kept across the evaluation
  (evaluation resets the compiled metrics it shares with training).

  Args:
    make_dataset: `fn() -> dataset` of evaluation batches (made once).
    steps: batches per evaluation.
    every_n_steps: evaluate when the global step reaches or crosses a
      multiple of this.
    train_steps: also evaluate when training reaches this step (None: no).
    on_metrics: callables `fn(step, metrics)`.
    timings: the run's `Timings` (evaluation time is added to it).
    split: name of the evaluated split, for the log.
  """

  def __init__(self, make_dataset: Callable[[], Any], *, steps: int, every_n_steps: int,
               train_steps: int | None = None,
               on_metrics: Sequence[Callable[[int, dict], None]] = (),
               timings: Timings | None = None, split: str = "eval"):
    super().__init__()
    if steps < 1 or every_n_steps < 1:
      raise errors.ConfigError(
          f"Evaluate needs steps >= 1 and every_n_steps >= 1, got {steps} and {every_n_steps}.")
    self.make_dataset = make_dataset
    self.steps = steps
    self.every_n_steps = every_n_steps
    self.train_steps = train_steps
    self.on_metrics = list(on_metrics)
    self.timings = timings or Timings()
    self.split = split
    self.history = []  # (step, metrics) of each evaluation.
    self._dataset = None
    self._cadence = policy.Cadence(
        policy.EveryNSteps(every_n_steps),
        *((policy.AtStep(train_steps),) if train_steps is not None else ()))

  @property
  def last(self) -> tuple[int, dict] | None:
    """(step, metrics) of the latest evaluation, or None."""
    return self.history[-1] if self.history else None

  def on_train_begin(self, logs=None):
    self._cadence.start(state_lib.global_step(self.model))

  def on_train_batch_end(self, batch, logs=None):
    step = state_lib.global_step(self.model)
    if self._cadence.due(step):
      self.evaluate(step)

  def evaluate(self, step: int | None = None) -> dict:
    """Evaluates now; returns the `val_*` metrics (every worker must call it)."""
    step = state_lib.global_step(self.model) if step is None else step
    if self._dataset is None:
      self._dataset = self.make_dataset()
    start = time.perf_counter()
    saved = [(v, v.numpy()) for m in self.model.metrics for v in m.variables]
    try:
      logs = self.model.evaluate(self._dataset, steps=self.steps, verbose=0,
                                 return_dict=True)
    finally:
      for v, value in saved:
        v.assign(value)
    metrics = {f"val_{k}": float(v) for k, v in logs.items()}
    self.timings.eval_seconds += time.perf_counter() - start
    self.history.append((step, metrics))
    logging.info("eval (%s, %d steps) at step %d: %s", self.split, self.steps, step,
                 format_metrics(metrics))
    for fn in self.on_metrics:
      fn(step, metrics)
    return metrics


def format_metrics(metrics: dict) -> str:
  """`name value, ...` with 4 significant digits."""
  return ", ".join(f"{k} {_num(v)}" for k, v in metrics.items())


def _num(v):
  v = float(v)
  return f"{v:.4g}" if math.isfinite(v) else str(v)


@dataclasses.dataclass
class RunSummary:
  """The end-of-run report of `tfdp-train` (printed by the chief)."""
  start_step: int
  step: int
  wall_seconds: float
  train_seconds: float
  global_batch_size: int
  timings: Timings
  train_metrics: dict
  eval: tuple | None  # (step, metrics, split) of the last evaluation.
  checkpoint: str | None
  model_path: str | None

  @property
  def examples_per_second(self) -> float | None:
    """Mean examples/s of this run's steps (evaluation time excluded)."""
    seconds = self.train_seconds - self.timings.eval_seconds
    steps = self.step - self.start_step
    return steps * self.global_batch_size / seconds if steps > 0 and seconds > 0 else None

  def lines(self) -> list[str]:
    """The summary as lines of text."""
    t = self.timings
    rate = self.examples_per_second
    out = [f"tfdp-train: finished at step {self.step} ({self.step - self.start_step} steps "
           f"from step {self.start_step})",
           f"  wall time     {self.wall_seconds:.1f} s (training {self.train_seconds:.1f} s, "
           f"of which evaluation {t.eval_seconds:.1f} s and checkpoint saves "
           f"{t.checkpoint_seconds:.1f} s in {len(t.saves)})",
           "  throughput    " + (f"{rate:.1f} examples/s (mean over this run's steps, "
                                 "evaluation excluded)" if rate else "-"),
           "  train         " + (format_metrics(self.train_metrics) or "-")]
    if self.eval:
      step, metrics, split = self.eval
      out.append(f"  eval          {format_metrics(metrics)} (split {split}, step {step})")
    out.append(f"  checkpoint    {self.checkpoint or '-'}")
    out.append(f"  model         {self.model_path or '-'}")
    return out
