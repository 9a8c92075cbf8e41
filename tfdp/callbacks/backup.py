"""BackupAndRestore: Keras's callback of that name over sharded, verified backups that resume exactly."""

import contextlib
import time

from absl import logging
import keras

from tfdp.callbacks import backup_watch
from tfdp.distribute import cluster
from tfdp import errors
from tfdp.resume import fit_hooks
from tfdp import goodput
from tfdp.liveness import preemption
from tfdp.resume import position as resume_lib
from tfdp.resume import train_state as state_lib
from tfdp.checkpoint.local import options as local_options_lib
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.persistent import retention
from tfdp.checkpoint.manager import CheckpointManager


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

  A backup also holds the run beyond the model: the state of every
  stateful callback of the `fit` (EarlyStopping, ModelCheckpoint,
  ReduceLROnPlateau, CSVLogger, TensorBoard, and any callback with
  `get_state()`/`set_state(state)`: `tfdp.resume.callback_state`) and each
  replica's part of the compiled metrics, so a resumed `fit` logs, writes
  and decides what the run that never stopped would. It acts after the
  other callbacks at every step and epoch end, wherever it is in the list.

  A backup also holds each worker's data position: under plain
  `model.fit(dataset, ...)` with any `tf.data` pipeline (or arrays), the
  iterator's state (shuffle buffers and their RNG, interleave cycles,
  prefetched elements) is saved per worker with the variables, and a `fit`
  resumed from the middle of an epoch runs the rest of that epoch on exactly
  the batches it would have seen (Keras's own callback restarts the epoch).
  This needs `tfdp.compat` (applied by `import tfdp`) and the same number of
  workers and replicas as the backup's; inputs tf.data cannot serialize
  (Python generators, `PyDataset`) restart the interrupted epoch, with a
  warning. With `tfdp.fit(model, make_dataset, ...)` and a `tfdp.data`
  source, the backup is restored before the dataset is made, which works on
  any number of workers.

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
      save at the same step and raise `tfdp.liveness.preemption.Preempted` (exit code
      `tfdp.liveness.preemption.EXIT_PREEMPTED` if uncaught).
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
    keep_best: also keep the best K backups by a metric, as
      `tfdp.CheckpointManager`'s (e.g. "val_loss:min:3"); the metrics are the
      epoch's logs and those given to `note_metrics()`.
    restart_epoch_data: resume a backup taken on another number of workers
      or replicas by restarting the interrupted epoch's data (its data
      positions cannot be split over another topology); otherwise such a
      resume raises ConfigError.
    local_checkpoint_dir, local_checkpoint_every_steps: a second, local tier
      saved every N steps (or "auto": as often as `checkpoint_overhead`
      allows) on each host, in RAM under /dev/shm by default, as
      `tfdp.CheckpointManager`'s: a resume takes the newest step any worker
      holds; a worker that lost its copy gets it from a peer, and its data
      position from its neighbour, which keeps a copy. The local copies are
      deleted when training completes.
    checkpoint_overhead: with "auto", the share of the training time the
      local saves may cost.
    allow_partial_restore: resume from a backup of another model (a layer
      added or removed, a width changed) by restoring what matches, as
      `tf.train.Checkpoint.restore(...).expect_partial()` and Keras's
      `skip_mismatch` do; the chief logs what was not restored. Otherwise
      such a backup is refused before any variable is assigned, with a
      `tfdp.errors.IncompatibleCheckpointError` naming it and the first
      differences.

  Raises:
    ValueError (a `tfdp.errors.ConfigError`): an empty backup_dir or an
      invalid save_freq, as Keras's callback; a backup_dir this process
      cannot create or write.
  """

  tfdp_runs_last = True  # tfdp.resume.fit_hooks moves it after the fit's other callbacks.

  @property
  def wants_data_state(self) -> bool:
    """Whether `fit` should give its data checkpointable iterators (tfdp.resume.fit_hooks).

    Not inside `tfdp.fit`, whose data starts at the restored step anyway.
    """
    return self._spanning is None

  def __init__(self, backup_dir: str, save_freq: str | int | bool = "epoch",
               double_checkpoint: bool = False, delete_checkpoint: bool = True, *,
               save_before_preemption: bool = False,
               preemption_grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS,
               run_config: dict | None = None, allow_config_mismatch: bool = False,
               async_save: bool = False, max_to_keep: int | None = -1,
               max_shard_bytes: int | None = None, save_at_end: bool = False,
               keep_best=None, restart_epoch_data: bool = False,
               local_checkpoint_dir: str | None = None,
               local_checkpoint_every_steps: int | str | None = None,
               checkpoint_overhead: float = local_options_lib.DEFAULT_OVERHEAD,
               allow_partial_restore: bool = False):
    super().__init__()
    if not backup_dir:
      raise errors.ConfigError("Empty `backup_dir` argument passed to BackupAndRestore.")
    self.backup_dir = str(backup_dir)
    backup_watch.check_writable(self.backup_dir)
    self.save_freq = save_freq
    self.double_checkpoint = double_checkpoint
    self.delete_checkpoint = delete_checkpoint
    self.run_config = dict(run_config or {})
    self.allow_config_mismatch = allow_config_mismatch
    self.async_save = async_save
    self.max_to_keep = (2 if double_checkpoint else 1) if max_to_keep == -1 else max_to_keep
    self.max_shard_bytes = max_shard_bytes
    self.save_at_end = save_at_end
    self.keep_best = None if keep_best is None else retention.parse_keep_best(keep_best)
    self.restart_epoch_data = restart_epoch_data
    # The local tier's settings, one value to the manager and its tier.
    self.local_options = local_options_lib.LocalOptions(
        local_checkpoint_every_steps, checkpoint_overhead, local_checkpoint_dir)
    self.allow_partial_restore = allow_partial_restore
    self._cadence = policy.EpochEndCadence(
        *(() if save_freq is False else (policy.from_save_freq(save_freq),)),
        policy.OnPreemption(), *((policy.AtTrainEnd(),) if save_at_end else ()),
        last_batch=self._ends_epoch)
    self._metrics = {}
    self._goodput = None
    self.state = None
    self.position = None
    self.manager = None
    self.resumed = resume_lib.Resume()
    self._spanning = None  # Inside tfdp.fit: its steps_per_epoch.
    self._first_epoch_done = 0  # Steps of this fit's first epoch done before it.
    self._preempted = False
    self._preemption = None
    if save_before_preemption:
      self._preemption = preemption.PreemptionCallback(
          self._save_for_preemption, handler=preemption.SignalHandler(
              preemption_grace_seconds))
    self._watch = backup_watch.Watch()

  local_checkpoint_dir = local_options_lib.field_property("directory")
  local_checkpoint_every_steps = local_options_lib.field_property("every_steps")
  checkpoint_overhead = local_options_lib.field_property("overhead")

  @property
  def restored_step(self) -> int | None:
    """The step of the backup the last restore restored, or None."""
    return self.resumed.step if self.resumed.restored else None

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
        self.position = resume_lib.Position(self.state.checkpoint, self)
    self.manager = CheckpointManager(
        self.state.checkpoint, self.backup_dir, max_to_keep=self.max_to_keep,
        async_save=self.async_save, max_shard_bytes=self.max_shard_bytes,
        keep_best=self.keep_best, per_worker=self.position.per_worker(),
        strategy=strategy, global_batch_size=self.run_config.get("global_batch_size"),
        local_options=self.local_options)
    # Its TensorBoard scalars would bring back a backup_dir deleted at the end.
    self._goodput = goodput.Recorder(self.backup_dir, chief=self.manager.is_chief,
                                     tensorboard=not self.delete_checkpoint)

  def restore(self, model: keras.Model | None = None, *, announce: bool = True) -> resume_lib.Resume:
    """Restores the newest intact backup into the model; returns where training goes on.

    Every worker must call it. A corrupt backup is set aside and the
    previous one, if any, is used (then a fresh start), with one line of the
    chief saying so. A backup of another model is refused (see
    `allow_partial_restore`). `model.fit` calls it at
    its start; `tfdp.fit` calls it once, before it makes the dataset.

    Args:
      model: the model (default: the callback's).
      announce: the chief prints the resume line (`fit` prints it itself,
        once it knows what became of the data position).

    Returns:
      The `tfdp.resume.position.Resume` (its `prefix` is None when nothing was
      restored), also kept as `self.resumed`.
    """
    model = model or self.model
    self._ensure_manager(model)
    self.position.reset()

    def check(prefix):
      for diff in state_lib.check_checkpoint(self.state, prefix, self.allow_config_mismatch):
        logging.warning("Resuming despite a config mismatch: %s (%s)", diff, prefix)

    start = time.perf_counter()
    with model.distribute_strategy.scope():
      prefix = self.manager.restore_newest_intact(
          before_restore=check, allow_partial_restore=self.allow_partial_restore,
          require_all=True)
    seconds = time.perf_counter() - start
    if prefix is None:  # A fresh start: nothing a failed attempt read of a backup stays.
      self.position.reset()
    self.resumed = self.position.read(prefix, self.state.step, self.manager.restored_tier)
    self.position.metrics_pending = self.resumed.mid_epoch
    self.position.take_chief_callbacks(prefix)
    self._goodput.restored(self.restored_step, seconds, self.manager.restored_tier)
    if self.resumed.restored:
      logging.info("Restored %s at step %d.", prefix, self.resumed.step)
      if announce:
        self.announce()
    return self.resumed

  def announce(self, data: str = "data from the step"):
    """The resume line, on the chief's stdout (a Keras script shows no absl INFO lines)."""
    if self.resumed.restored and self.manager.is_chief:
      print(f"tfdp: {self.resumed.describe(data)}", flush=True)

  def completed_epochs(self, steps_per_epoch: int | None = None) -> int | None:
    """Epochs completed by the restored backup (None when nothing was restored)."""
    return self.resumed.completed_epochs(steps_per_epoch)

  @contextlib.contextmanager
  def spanning_fit_calls(self, model: keras.Model, steps_per_epoch: int):
    """Makes several `model.fit` calls one training run (what `tfdp.fit` does).

    Inside, `fit` calls neither restore nor delete the backup; restore once
    with `restore()` before the first, and the backup is finished (saved at
    the end if asked, deleted if asked) when the block exits normally.
    Epoch e covers global steps [e * steps_per_epoch, (e + 1) * steps_per_epoch).
    """
    self._spanning = steps_per_epoch
    self._preempted = False
    if self._preemption is not None:
      self._preemption.handler.install()
    try:
      yield self
    finally:
      self._spanning = None
      if self._preemption is not None:
        self._preemption.handler.uninstall()
    self._finish(model)

  def save(self, step: int | None = None) -> str | None:
    """Saves a backup at the current global step (every worker must call it)."""
    step = state_lib.global_step(self.model) if step is None else step
    self._save_if(policy.Cadence(policy.Always()), step)
    return self.manager.latest_checkpoint

  def note_metrics(self, metrics: dict) -> None:
    """Metrics (name -> number) stored with the next backups, for `keep_best`."""
    for name, value in metrics.items():
      try:
        self._metrics[str(name)] = float(value)
      except (TypeError, ValueError):
        pass  # Not a number (e.g. a learning-rate schedule's config).

  def _save_if(self, cadence, step, advance=False, **when) -> None:
    """Saves at `step` (every worker) when `cadence` says so; at a batch's end, locally too when due."""
    due = cadence.due(step, last_saved_step=self.manager.last_saved_step, advance=advance, **when)
    if due or advance:  # One call for both tiers, from one snapshot.
      with self.position.saving(step):
        self.manager.save_at_step(step, persistent=due, local=advance, metrics=self._metrics,
                                  blocked=self._blocked)

  def _blocked(self, seconds, tier):
    """Goodput's: the time a save of `tier` blocked training (with a local save, the interval now)."""
    self._goodput.blocked(seconds, tier)
    if tier == "local":
      self._goodput.interval(self.manager.local_interval)

  def _save_for_preemption(self, step):
    self._save_if(self._cadence, step, preempted=True)
    # Releases the directory too: the job restarted elsewhere takes it at once.
    self.manager.close()
    self._preempted = True
    return self.manager.latest_checkpoint

  def on_train_begin(self, logs=None):
    skipped = 0
    if self._spanning is None:
      resumed = self.restore(self.model, announce=False)
      epoch = resumed.completed_epochs((self.params or {}).get("steps"))
      if epoch is not None:
        self.model._initial_epoch = epoch  # pylint: disable=protected-access
      skipped, data = resume_lib.resume_data(resumed, self.model, self.backup_dir,
                                             self.restart_epoch_data, backup_watch.why_no_hooks)
      self.announce(data)
      self._preempted = False
      if self._preemption is not None:
        self._preemption.handler.install()
    self._ensure_manager(self.model)
    run = fit_hooks.current(self.model)
    self.position.topology.assign(
        resume_lib.topology(self.model.distribute_strategy)
        if run is not None and run.dataset is not None else (0, 0))
    step = state_lib.global_step(self.model)
    self._first_epoch_done = skipped
    self._cadence.start(step)
    self.position.continue_callbacks(self)

  def on_epoch_begin(self, epoch, logs=None):
    step = state_lib.global_step(self.model)
    self.position.epoch_begin(epoch)
    if self._spanning is not None:
      self.position.epoch_first_step = epoch * self._spanning
    else:
      self.position.epoch_first_step = step - self._first_epoch_done
    self._first_epoch_done = 0
    self.position.continue_metrics()

  def on_train_batch_end(self, batch, logs=None):
    step = state_lib.global_step(self.model)
    # Counted before its saves: a crash inside one counts it as reached (recomputed after).
    self._goodput.step(step)
    self.position.batch_end(step)
    self._save_if(self._cadence, step, advance=True)
    if self._preemption is not None:
      self._preemption.on_train_batch_end(batch, logs)

  def on_epoch_end(self, epoch, logs=None):
    self.position.epoch_end(epoch)
    self.note_metrics(logs or {})
    self._metrics["epoch"] = epoch + 1  # Whose metrics a backup holds (tfdp-ckpt inspect).
    self._save_if(self._cadence, state_lib.global_step(self.model), epoch_end=True)

  def on_train_end(self, logs=None):
    self.manager.wait_until_finished()
    if self._spanning is None:
      if self._preemption is not None:
        self._preemption.handler.uninstall()
      self._finish(self.model)
    self.position.data.fit_ended()

  def _finish(self, model):
    """End of a completed run: the final save if asked, then the deletion if asked."""
    if self.manager is None or self._preempted:
      return
    step = state_lib.global_step(model)
    self._save_if(self._cadence, step, train_end=True)
    self.manager.close()  # Waits for the last save; releases the directory.
    self.manager.drop_local()  # The persistent tier holds the end.
    self._goodput.finished(step)  # Its summary and line come before any deletion.
    if not self.delete_checkpoint:
      return  # A later save takes the directory again.
    # Every worker has returned from its last save before the chief deletes
    # the directory: a worker still waiting for that save's commit would
    # otherwise wait for a manifest that no longer exists.
    cluster.agree(0.0, "max", model.distribute_strategy)
    manager, self.manager = self.manager, None
    manager.delete_directory()

  def on_train_batch_begin(self, batch, logs=None):
    if self.manager is not None and self.manager.is_chief:
      self._watch.batch_begin(self)

  def _ends_epoch(self, step: int) -> bool:
    """Whether `step` is the current epoch's last (when the epoch's number of steps is known)."""
    return self.position.ends_epoch(step, self._spanning or (self.params or {}).get("steps"))
