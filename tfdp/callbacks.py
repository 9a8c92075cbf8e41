"""Keras callbacks: periodic sharded checkpoints, exact backup and restore, throughput logging."""

import time

from absl import logging
import keras
import tensorflow as tf

from tfdp import errors
from tfdp import preemption


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
    self.last_saved_step = None

  def on_train_begin(self, logs=None):
    self._last = _iterations(self.model)

  def on_train_batch_end(self, batch, logs=None):
    if not self.every_n_steps:
      return
    step = _iterations(self.model)
    if step // self.every_n_steps > self._last // self.every_n_steps:
      self.manager.save(checkpoint_number=step)
      self.last_saved_step = step
    self._last = step


class BackupAndRestore(keras.callbacks.Callback):
  """Drop-in for `keras.callbacks.BackupAndRestore` that resumes exactly, mid-epoch too.

  Saves a `tfdp.TrainState` (every model and optimizer variable, including
  the optimizer's iteration count and the RNG state of dropout and other
  `SeedGenerator`s) through a sharded `tfdp.CheckpointManager`, numbered by
  the global step. Every worker of a multi-worker job must use it.

  With `tfdp.fit(model, make_dataset, epochs=..., steps_per_epoch=...,
  callbacks=[this])` the state is restored before the dataset is made, so
  the data starts at the restored step and the run continues bitwise as if
  never stopped. Under plain `model.fit` it restores the state and skips the
  finished epochs (Keras's semantics); a checkpoint from the middle of an
  epoch then restarts that epoch's data from its first batch (with a
  warning), because `fit` made its iterator before any callback ran.

  Args:
    backup_dir: directory of the backups (shared by all workers; used by
      nothing else).
    save_freq: "epoch", or an int N to save whenever the global step is a
      multiple of N (which survives resumes, unlike a count of batches).
    double_checkpoint: keep the previous backup too; restore falls back to
      it if the newest is corrupt.
    delete_checkpoint: delete `backup_dir` when training completes (not
      when it is preempted or fails).
    save_before_preemption: on SIGTERM/SIGINT to any worker, all workers
      save at the same step and raise `tfdp.preemption.Preempted` (exit code
      `tfdp.preemption.EXIT_PREEMPTED` if uncaught).
    preemption_grace_seconds: the time from the signal to a forced exit.
    run_config: dict saved with the state (e.g. global_batch_size, dataset,
      seed); a backup whose entries differ is refused unless
      `allow_config_mismatch`.
    allow_config_mismatch: restore a backup of another run config anyway.
    async_save: write backups in the background.
  """

  def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
               delete_checkpoint=True, *, save_before_preemption=False,
               preemption_grace_seconds=preemption.DEFAULT_GRACE_SECONDS,
               run_config=None, allow_config_mismatch=False, async_save=False):
    super().__init__()
    if not backup_dir:
      raise errors.ConfigError("BackupAndRestore needs a backup_dir.")
    if save_freq != "epoch" and (
        not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1):
      raise errors.ConfigError(
          f"save_freq must be 'epoch' or a positive int of steps, got {save_freq!r}.")
    self.backup_dir = str(backup_dir)
    self.save_freq = save_freq
    self.double_checkpoint = double_checkpoint
    self.delete_checkpoint = delete_checkpoint
    self.run_config = dict(run_config or {})
    self.allow_config_mismatch = allow_config_mismatch
    self.async_save = async_save
    self.state = None
    self.manager = None
    self.restored_step = None
    self._restored = False
    self._last_saved = None
    self._preempted = False
    self._target_step = None  # Set by tfdp.fit: the step training ends at.
    self._preemption = None
    if save_before_preemption:
      self._preemption = preemption.PreemptionCallback(
          self._save_for_preemption, handler=preemption.SignalHandler(
              preemption_grace_seconds))

  def set_model(self, model):
    super().set_model(model)
    if self._preemption is not None:
      self._preemption.set_model(model)

  def _ensure_manager(self, model):
    if self.manager is not None:
      return
    # pylint: disable=g-import-not-at-top
    from tfdp import state as state_lib
    from tfdp.checkpoint import CheckpointManager
    # pylint: enable=g-import-not-at-top
    if not model.built:
      raise errors.ConfigError(
          "BackupAndRestore needs a built model: build it (call it on a batch "
          "or give it an Input) before fit.")
    strategy = model.distribute_strategy
    with strategy.scope():
      self.state = state_lib.TrainState(model, run_config=self.run_config)
    self.manager = CheckpointManager(
        self.state.checkpoint, self.backup_dir,
        max_to_keep=2 if self.double_checkpoint else 1,
        async_save=self.async_save, strategy=strategy,
        global_batch_size=self.run_config.get("global_batch_size"))

  def restore(self, model=None):
    """Restores the newest intact backup into the model (once); returns its step or None.

    `tfdp.fit` calls it before it makes the dataset; `on_train_begin` calls
    it under plain `model.fit`.
    """
    model = model or self.model
    if self._restored:
      return self.restored_step
    self._restored = True
    self._ensure_manager(model)
    # pylint: disable=g-import-not-at-top
    from tfdp import state as state_lib
    # pylint: enable=g-import-not-at-top
    with model.distribute_strategy.scope():
      prefix = self.manager.restore_newest_intact(
          before_restore=lambda p: state_lib.check_checkpoint(
              self.state, p, self.allow_config_mismatch))
    if prefix is None:
      return None
    self.restored_step = self.state.step
    self._last_saved = self.restored_step
    logging.info("tfdp: restored %s at step %d.", prefix, self.restored_step)
    return self.restored_step

  def save(self, step=None):
    """Saves a backup at the current global step (every worker must call it)."""
    step = _iterations(self.model) if step is None else step
    if step == self._last_saved:
      return self.manager.latest_checkpoint
    self.manager.save(checkpoint_number=step)
    self._last_saved = step
    return self.manager.latest_checkpoint

  def _save_for_preemption(self, step):
    self.save(step)
    self.manager.wait_until_finished()
    self._preempted = True
    return self.manager.latest_checkpoint

  def on_train_begin(self, logs=None):
    tfdp_fit = self._target_step is not None
    if not self._restored:
      step = self.restore(self.model)
      steps = (self.params or {}).get("steps")
      if step and not tfdp_fit and steps:
        epoch, offset = divmod(step, steps)
        if offset:
          logging.warning(
              "tfdp: the backup is at step %d, inside epoch %d; model.fit made "
              "its data iterator before this callback ran, so the epoch's data "
              "restarts from its first batch. Use tfdp.fit(...) to resume "
              "exactly.", step, epoch + 1)
        self.model._initial_epoch = epoch  # pylint: disable=protected-access
    self._ensure_manager(self.model)
    if self._preemption is not None:
      self._preemption.handler.install()

  def on_train_batch_end(self, batch, logs=None):
    step = _iterations(self.model)
    if self.save_freq != "epoch" and step % self.save_freq == 0:
      self.save(step)
    if self._preemption is not None:
      self._preemption.on_train_batch_end(batch, logs)

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq == "epoch":
      self.save()

  def on_train_end(self, logs=None):
    self.manager.wait_until_finished()
    step = _iterations(self.model)
    finished = (self._target_step is None and not self.model.stop_training) or (
        self._target_step is not None and step >= self._target_step)
    if not finished:
      return
    if self._preemption is not None:
      self._preemption.handler.uninstall()
    if self.delete_checkpoint and not self._preempted:
      worker = self.manager.worker_index
      self.manager.close()
      if worker == 0 and tf.io.gfile.exists(self.backup_dir):
        tf.io.gfile.rmtree(self.backup_dir)


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
