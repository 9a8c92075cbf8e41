"""Wall time a run spends outside its training steps: the shared Timings record and the CheckpointTimer that fills it."""

import dataclasses
import time

import keras

from tfdp.resume import train_state as state_lib


@dataclasses.dataclass
class Timings:
  """Wall time a run spent outside its training steps, shared by the callbacks that measure it.

  Attributes:
    eval_seconds: total time in evaluation.
    checkpoint_seconds: total time the training loop was blocked in
      checkpoint saves (for async saves: the copy to host memory and the
      wait for the previous write).
    saves: (global step, seconds blocked) of each save seen.
  """
  eval_seconds: float = 0.0
  checkpoint_seconds: float = 0.0
  saves: list = dataclasses.field(default_factory=list)


def _last_saved_step(callback) -> int | None:
  manager = getattr(callback, "manager", None)
  return getattr(manager, "last_saved_step", getattr(callback, "last_saved_step", None))


class CheckpointTimer:
  """Times the saves of a checkpoint callback by bracketing it in the callback list.

  Keras calls callbacks in list order, so the time between a marker placed
  just before the checkpoint callback and one just after it is the time the
  step spent in that callback: the save when it saved (its manager's
  `last_saved_step` moved to this step), else the cost of deciding not to.

  Usage: `callbacks = [..., *timer.bracket(), ...]` with
  `timer = CheckpointTimer(backup, timings)`, and `timer.after_fit(step)`
  once `tfdp.fit` returns, for the final save it makes after the last step.
  """

  def __init__(self, callback: keras.callbacks.Callback, timings: Timings):
    self.callback = callback
    self.timings = timings
    self._start = None
    self._train_end = None
    timer = self

    class _Start(keras.callbacks.Callback):
      def on_train_batch_end(self, batch, logs=None):
        timer._start = time.perf_counter()

      def on_train_end(self, logs=None):
        timer._train_end = time.perf_counter()

    class _Stop(keras.callbacks.Callback):
      def on_train_batch_end(self, batch, logs=None):
        timer._stopped(self.model)

    self._markers = (_Start(), _Stop())

  def bracket(self) -> list:
    """[start marker, the checkpoint callback, stop marker], to put in the callback list as one."""
    return [self._markers[0], self.callback, self._markers[1]]

  def _stopped(self, model):
    if self._start is None:
      return
    seconds, self._start = time.perf_counter() - self._start, None
    self._record(state_lib.global_step(model), seconds)

  def _record(self, step, seconds):
    if _last_saved_step(self.callback) == step and (
        not self.timings.saves or self.timings.saves[-1][0] != step):
      self.timings.saves.append((step, seconds))
      self.timings.checkpoint_seconds += seconds
      return True
    return False

  def after_fit(self, step: int) -> float | None:
    """Records the final save, made after the last step; returns its seconds, or None.

    Measured from the end of the last `fit` call to now: the final save and
    the wait for any background write. None when the last step had saved
    already (or nothing saved).
    """
    if self._train_end is None:
      return None
    seconds, self._train_end = time.perf_counter() - self._train_end, None
    return seconds if self._record(step, seconds) else None
