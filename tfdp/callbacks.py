"""Keras callbacks: periodic sharded checkpoints, exact backup and restore, throughput logging."""

import contextlib
import time

from absl import logging
import keras
import tensorflow as tf

from tfdp import cluster
from tfdp import errors
from tfdp import preemption
from tfdp import state as state_lib
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint import policy as policy_lib

# Name of the completed-epoch counter a BackupAndRestore adds to its state
# (Keras's callback keeps the same number in its training metadata).
EPOCH_KEY = "keras_epoch"


def _iterations(model) -> int:
  return int(model.optimizer.iterations.numpy())


def _save_if_due(manager, decision, step, previous_step, **when) -> bool:
  """Saves at `step` (every worker) when `decision` says so; returns whether it saved."""
  ctx = policy_lib.SaveContext(step=step, previous_step=previous_step,
                               last_saved_step=manager.last_saved_step, **when)
  if not decision.should_save(ctx):
    return False
  manager.save(checkpoint_number=step)
  return True


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
    self._decision = policy_lib.AnyOf(
        (policy_lib.EveryNSteps(every_n_steps),) if every_n_steps else ())
    self._previous = None

  @property
  def last_saved_step(self) -> int | None:
    return self.manager.last_saved_step

  def on_train_begin(self, logs=None):
    self._previous = _iterations(self.model)

  def on_train_batch_end(self, batch, logs=None):
    step = _iterations(self.model)
    _save_if_due(self.manager, self._decision, step, self._previous)
    self._previous = step


class BackupAndRestore(keras.callbacks.Callback):
  """Drop-in for `keras.callbacks.BackupAndRestore` that saves sharded, verified, complete state.

  The same constructor and semantics as Keras's: every `model.fit` call
  restores the newest backup at its start (so an interrupted `fit` called
  again with the same callback, or with a new one, continues) and skips the
  epochs already completed; backups are taken at the end of every epoch, or
  every `save_freq` steps; the backup directory is deleted when `fit`
  completes, unless `delete_checkpoint=False`. What a backup holds is more:
  a `tfdp.TrainState` (every model and optimizer variable, including the
  optimizer's iteration count and the RNG state of dropout and other
  `SeedGenerator`s), saved through a sharded `tfdp.CheckpointManager`
  numbered by the global step. Every worker of a multi-worker job must use it.

  With `tfdp.fit(model, make_dataset, ...)` the backup is restored once,
  before the dataset is made, so the data starts at the restored step and
  the run continues bitwise as if never stopped. Under plain `model.fit`, a
  backup from the middle of an epoch restarts that epoch's data from its
  first batch (as Keras's does), because `fit` made its iterator before any
  callback ran.

  Args:
    backup_dir: directory of the backups (shared by all workers; used by
      nothing else).
    save_freq: "epoch"; an int N to save whenever the global step reaches or
      crosses a multiple of N (global steps survive resumes, unlike a count
      of batches); or False to save only on preemption (and at the end with
      `save_at_end`).
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
    allow_config_mismatch: restore a backup of another run config anyway
      (the differences are logged).
    async_save: write backups in the background.
    max_to_keep: backups to keep (default 1, or 2 with double_checkpoint;
      None keeps all).
    max_shard_bytes: cap on each data file a worker writes.
    save_at_end: also save when training completes (before any deletion).

  Raises:
    ValueError (a `tfdp.errors.ConfigError`): an empty backup_dir or an
      invalid save_freq, as Keras's callback.
  """

  def __init__(self, backup_dir: str, save_freq: str | int | bool = "epoch",
               double_checkpoint: bool = False, delete_checkpoint: bool = True, *,
               save_before_preemption: bool = False,
               preemption_grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS,
               run_config: dict | None = None, allow_config_mismatch: bool = False,
               async_save: bool = False, max_to_keep: int | None = -1,
               max_shard_bytes: int | None = None, save_at_end: bool = False):
    super().__init__()
    if not backup_dir:
      raise errors.ConfigError("Empty `backup_dir` argument passed to BackupAndRestore.")
    policies = []
    if save_freq is not False:
      policies.append(policy_lib.from_save_freq(save_freq))
    self.backup_dir = str(backup_dir)
    self.save_freq = save_freq
    self.double_checkpoint = double_checkpoint
    self.delete_checkpoint = delete_checkpoint
    self.run_config = dict(run_config or {})
    self.allow_config_mismatch = allow_config_mismatch
    self.async_save = async_save
    self.max_to_keep = (2 if double_checkpoint else 1) if max_to_keep == -1 else max_to_keep
    self.max_shard_bytes = max_shard_bytes
    self.save_at_end = save_at_end
    self._decision = policy_lib.AnyOf(tuple(policies) + (
        policy_lib.OnPreemption(),) + ((policy_lib.AtTrainEnd(),) if save_at_end else ()))
    self.state = None
    self.manager = None
    self.restored_step = None
    self._epoch = None
    self._previous = None
    self._spanning = False
    self._preempted = False
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
    if not model.built:
      raise errors.ConfigError(
          "To use BackupAndRestore, the model must be built before fit: call "
          "it on a batch of data or give it a keras.Input.")
    strategy = model.distribute_strategy
    with strategy.scope():
      if self.state is None or self.state.model is not model:
        self.state = state_lib.TrainState(model, run_config=self.run_config)
        self._epoch = tf.Variable(-1, dtype=tf.int64, trainable=False, name=EPOCH_KEY)
        setattr(self.state.checkpoint, EPOCH_KEY, self._epoch)
    self.manager = CheckpointManager(
        self.state.checkpoint, self.backup_dir, max_to_keep=self.max_to_keep,
        async_save=self.async_save, max_shard_bytes=self.max_shard_bytes,
        strategy=strategy, global_batch_size=self.run_config.get("global_batch_size"))

  def restore(self, model: keras.Model | None = None) -> int | None:
    """Restores the newest intact backup into the model; returns its step, or None.

    Every worker must call it. A corrupt backup is set aside (with a
    warning) and the previous one, if any, is used. `model.fit` calls it at
    its start; `tfdp.fit` calls it once, before it makes the dataset.
    """
    model = model or self.model
    self._ensure_manager(model)
    self._epoch.assign(-1)

    def check(prefix):
      for diff in state_lib.check_checkpoint(self.state, prefix, self.allow_config_mismatch):
        logging.warning("Resuming despite a config mismatch: %s (%s)", diff, prefix)

    with model.distribute_strategy.scope():
      prefix = self.manager.restore_newest_intact(before_restore=check)
    if prefix is None:
      self.restored_step = None
      return None
    self.restored_step = self.state.step
    logging.info("Restored %s at step %d.", prefix, self.restored_step)
    return self.restored_step

  def completed_epochs(self, steps_per_epoch: int | None = None) -> int | None:
    """Epochs completed by the restored backup (None when nothing was restored)."""
    if self.restored_step is None:
      return None
    epoch = int(self._epoch.numpy())
    if epoch < 0 and steps_per_epoch:  # A backup without the counter.
      epoch = self.restored_step // steps_per_epoch
    return max(epoch, 0)

  @contextlib.contextmanager
  def spanning_fit_calls(self, model: keras.Model):
    """Makes several `model.fit` calls one training run (what `tfdp.fit` does).

    Inside, `fit` calls neither restore nor delete the backup; restore once
    with `restore()` before the first, and the backup is finished (saved at
    the end if asked, deleted if asked) when the block exits normally.
    """
    self._spanning = True
    self._preempted = False
    if self._preemption is not None:
      self._preemption.handler.install()
    try:
      yield self
    finally:
      self._spanning = False
      if self._preemption is not None:
        self._preemption.handler.uninstall()
    self._finish(model)

  def save(self, step: int | None = None) -> str | None:
    """Saves a backup at the current global step (every worker must call it)."""
    step = _iterations(self.model) if step is None else step
    if self.manager.last_saved_step != step:
      self.manager.save(checkpoint_number=step)
    return self.manager.latest_checkpoint

  def _save_for_preemption(self, step):
    _save_if_due(self.manager, self._decision, step, self._previous, preempted=True)
    # Releases the directory too: the job restarted elsewhere takes it at once.
    self.manager.close()
    self._preempted = True
    return self.manager.latest_checkpoint

  def on_train_begin(self, logs=None):
    if not self._spanning:
      self.restore(self.model)
      epoch = self.completed_epochs((self.params or {}).get("steps"))
      if epoch is not None:
        self.model._initial_epoch = epoch  # pylint: disable=protected-access
      self._preempted = False
      if self._preemption is not None:
        self._preemption.handler.install()
    self._ensure_manager(self.model)
    self._previous = _iterations(self.model)

  def on_train_batch_end(self, batch, logs=None):
    step = _iterations(self.model)
    _save_if_due(self.manager, self._decision, step, self._previous)
    self._previous = step
    if self._preemption is not None:
      self._preemption.on_train_batch_end(batch, logs)

  def on_epoch_end(self, epoch, logs=None):
    self._epoch.assign(epoch + 1)
    _save_if_due(self.manager, self._decision, _iterations(self.model), self._previous,
                 epoch_end=True)

  def on_train_end(self, logs=None):
    self.manager.wait_until_finished()
    if not self._spanning:
      if self._preemption is not None:
        self._preemption.handler.uninstall()
      self._finish(self.model)

  def _finish(self, model):
    """End of a completed run: the final save if asked, then the deletion if asked."""
    if self.manager is None or self._preempted:
      return
    _save_if_due(self.manager, self._decision, _iterations(model), self._previous,
                 train_end=True)
    self.manager.close()  # Waits for the last save; releases the directory.
    if not self.delete_checkpoint:
      return  # A later save takes the directory again.
    # Every worker has returned from its last save before the chief deletes
    # the directory: a worker still waiting for that save's commit would
    # otherwise wait for a manifest that no longer exists.
    cluster.agree(0.0, "max", model.distribute_strategy)
    manager, self.manager = self.manager, None
    if manager.worker_index == 0 and tf.io.gfile.exists(self.backup_dir):
      tf.io.gfile.rmtree(self.backup_dir)


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
