"""CheckpointEvery and Throughput: a save through a tfdp.CheckpointManager every N global steps, and steps per second logged."""

import time

from absl import logging
import keras

from tfdp.resume import train_state as state_lib
from tfdp.callbacks.backup import BackupAndRestore
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.manager import CheckpointManager

__all__ = ["BackupAndRestore", "CheckpointEvery", "Throughput"]


class CheckpointEvery(keras.callbacks.Callback):
  """Saves through a `tfdp.CheckpointManager` every `every_n_steps` global steps.

  The checkpoint number is the global step (the optimizer's iterations), so a
  checkpoint's name says where training resumes. Every worker must run it:
  each writes its own shard.

  Args:
    manager: a `tfdp.CheckpointManager`.
    every_n_steps: save when the step reaches or crosses a multiple of this;
      None or 0 never saves during training.
  """

  def __init__(self, manager: CheckpointManager, every_n_steps: int | None):
    super().__init__()
    self.manager = manager
    self.every_n_steps = every_n_steps
    self._cadence = policy.Cadence(
        *((policy.EveryNSteps(every_n_steps),) if every_n_steps else ()))

  @property
  def last_saved_step(self) -> int | None:
    return self.manager.last_saved_step

  def on_train_begin(self, logs=None):
    self._cadence.start(state_lib.global_step(self.model))

  def on_train_batch_end(self, batch, logs=None):
    step = state_lib.global_step(self.model)
    if self._cadence.due(step, last_saved_step=self.manager.last_saved_step):
      self.manager.save(checkpoint_number=step)


class Throughput(keras.callbacks.Callback):
  """Logs examples per second over each epoch (chief only, through absl)."""

  def __init__(self, global_batch_size: int):
    super().__init__()
    self.global_batch_size = global_batch_size
    self._start = None
    self._steps = 0
    self.history = []

  def on_epoch_begin(self, epoch, logs=None):
    self._start, self._steps = time.perf_counter(), 0

  def on_train_batch_end(self, batch, logs=None):
    self._steps += 1

  def on_epoch_end(self, epoch, logs=None):
    seconds = time.perf_counter() - self._start
    if self._steps and seconds > 0:
      rate = self._steps * self.global_batch_size / seconds
      self.history.append(rate)
      logging.info("epoch %d: %.1f examples/s over %d steps", epoch + 1, rate,
                   self._steps)
