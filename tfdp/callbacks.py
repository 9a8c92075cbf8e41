"""Keras callbacks: periodic sharded checkpoints and throughput logging."""

import time

from absl import logging
import keras


def _iterations(model):
  return int(model.optimizer.iterations.numpy())


class CheckpointEvery(keras.callbacks.Callback):
  """Saves through a `tfdp.CheckpointManager` every `every_n_steps` global steps.

  The checkpoint number is the global step (the optimizer's iterations), so a
  checkpoint's name says where training resumes. Every worker must run it:
  each writes its own shard.

  Args:
    manager: a `tfdp.CheckpointManager` (or anything with
      `save(checkpoint_number=...)`).
    every_n_steps: save when the step crosses a multiple of this; None or 0
      never saves during training.
  """

  def __init__(self, manager, every_n_steps):
    super().__init__()
    self.manager = manager
    self.every_n_steps = every_n_steps
    self._last = None

  def on_train_begin(self, logs=None):
    self._last = _iterations(self.model)

  def on_train_batch_end(self, batch, logs=None):
    if not self.every_n_steps:
      return
    step = _iterations(self.model)
    if step // self.every_n_steps > self._last // self.every_n_steps:
      self.manager.save(checkpoint_number=step)
    self._last = step


class Throughput(keras.callbacks.Callback):
  """Logs examples per second over each epoch (chief only, through absl)."""

  def __init__(self, global_batch_size):
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
