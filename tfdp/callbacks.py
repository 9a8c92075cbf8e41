"""Keras callbacks: periodic sharded checkpoints, exact backup and restore, throughput logging."""

import contextlib
import time

from absl import logging
import keras
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tfdp import cluster
from tfdp import errors
from tfdp import fit_hooks
from tfdp import goodput
from tfdp import preemption
from tfdp import state as state_lib
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint import policy as policy_lib

# Name of the completed-epoch counter a BackupAndRestore adds to its state
# (Keras's callback keeps the same number in its training metadata).
EPOCH_KEY = "keras_epoch"
# Steps of the current epoch done (-1: unknown, a backup without it), and the
# [workers, replicas] whose data positions a backup holds ([0, 0]: none).
STEP_IN_EPOCH_KEY = "keras_step_in_epoch"
DATA_TOPOLOGY_KEY = "data_topology"
# The per-worker state key of the data position.
DATA_KEY = "data"


def _iterations(model) -> int:
  return int(model.optimizer.iterations.numpy())


def _save_if_due(manager, decision, step, previous_step, metrics=None, recorder=None,
                 **when) -> bool:
  """Saves at `step` (every worker) when `decision` says so; returns whether it saved.

  The time training was blocked goes to `recorder` (a tfdp.goodput.Recorder).
  """
  ctx = policy_lib.SaveContext(step=step, previous_step=previous_step,
                               last_saved_step=manager.last_saved_step, **when)
  if not decision.should_save(ctx):
    return False
  start = time.perf_counter()
  manager.save(checkpoint_number=step, metrics=metrics)
  if recorder is not None:
    recorder.blocked(time.perf_counter() - start, "persistent")
  return True


def _topology(strategy) -> list[int]:
  return [cluster.resolve(strategy).count, strategy.num_replicas_in_sync]


class _DataPosition(trackable_base.Trackable):
  """A backup's per-worker part: where this worker's training data is.

  Saved with every backup (each worker under its own key, in the same commit
  as the variables, taken at the same step); restored into the iterator the
  resumed `fit` makes first.
  """

  def __init__(self, callback):
    self._callback = callback
    self.restored = None
    self.kind = "none"
    self._warned = False

  @property
  def tfdp_required(self) -> bool:
    """Whether the last saved position must be restored exactly (peer recovery needs it not to be)."""
    return self.kind != "none"

  def _serialize_to_tensors(self):
    cb = self._callback
    run = fit_hooks.current(cb.model) if cb.model is not None else None
    state, made, kind = tf.constant(b""), 0, "none"
    if run is not None and run.dataset is not None:
      it = run.next_iterator(at_epoch_end=int(cb._step_in_epoch.numpy()) == 0)  # pylint: disable=protected-access
      made, kind = run.dataset.iterators_made, "fresh"
      if it is not None:
        made = it._index - 1  # pylint: disable=protected-access
        try:
          state, kind = it.state_tensor(), "iterator"
        except errors.CheckpointError as e:
          kind = "none"
          if not self._warned:
            self._warned = True
            logging.warning("tfdp: backups will not hold the data position: %s", e)
    self.kind = kind
    return {"state": state, "made": tf.constant(made, tf.int64),
            "kind": tf.constant(kind)}

  def _restore_from_tensors(self, restored_tensors):
    self.restored = {k: v.numpy() for k, v in restored_tensors.items()}
    return []


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
    keep_best: also keep the best K backups by a metric, as
      `tfdp.CheckpointManager`'s (e.g. "val_loss:min:3"); the metrics are the
      epoch's logs and those given to `note_metrics()`.
    restart_epoch_data: resume a backup taken on another number of workers
      or replicas by restarting the interrupted epoch's data (its data
      positions cannot be split over another topology); otherwise such a
      resume raises ConfigError.
    local_checkpoint_dir, local_checkpoint_every_steps: a second, local tier
      saved every N steps on each host (in RAM under /dev/shm by default),
      as `tfdp.CheckpointManager`'s: a resume takes the newest step any
      worker holds; a worker that lost its copy gets it from the others by
      collectives (not when the data position of plain `fit` is in it: then
      the newest step every worker holds, else the persistent tier). The
      local copies are deleted when training completes.

  Raises:
    ValueError (a `tfdp.errors.ConfigError`): an empty backup_dir or an
      invalid save_freq, as Keras's callback.
  """

  @property
  def wants_data_state(self) -> bool:
    """Whether `fit` should give its data checkpointable iterators (tfdp.fit_hooks).

    Not inside `tfdp.fit`, whose data starts at the restored step anyway.
    """
    return not self._spanning

  def __init__(self, backup_dir: str, save_freq: str | int | bool = "epoch",
               double_checkpoint: bool = False, delete_checkpoint: bool = True, *,
               save_before_preemption: bool = False,
               preemption_grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS,
               run_config: dict | None = None, allow_config_mismatch: bool = False,
               async_save: bool = False, max_to_keep: int | None = -1,
               max_shard_bytes: int | None = None, save_at_end: bool = False,
               keep_best=None, restart_epoch_data: bool = False,
               local_checkpoint_dir: str | None = None,
               local_checkpoint_every_steps: int | None = None):
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
    self.keep_best = keep_best
    self.restart_epoch_data = restart_epoch_data
    self.local_checkpoint_dir = local_checkpoint_dir
    self.local_checkpoint_every_steps = local_checkpoint_every_steps
    self._local_decision = policy_lib.AnyOf(
        (policy_lib.EveryNSteps(local_checkpoint_every_steps),)
        if local_checkpoint_every_steps else ())
    self._metrics = {}
    self._data = _DataPosition(self)
    self._goodput = None
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
        self._step_in_epoch = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                          name=STEP_IN_EPOCH_KEY)
        self._data_topology = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                          name=DATA_TOPOLOGY_KEY)
        setattr(self.state.checkpoint, EPOCH_KEY, self._epoch)
        setattr(self.state.checkpoint, STEP_IN_EPOCH_KEY, self._step_in_epoch)
        setattr(self.state.checkpoint, DATA_TOPOLOGY_KEY, self._data_topology)
    self.manager = CheckpointManager(
        self.state.checkpoint, self.backup_dir, max_to_keep=self.max_to_keep,
        async_save=self.async_save, max_shard_bytes=self.max_shard_bytes,
        keep_best=self.keep_best, per_worker={DATA_KEY: self._data},
        strategy=strategy, global_batch_size=self.run_config.get("global_batch_size"),
        local_checkpoint_dir=self.local_checkpoint_dir,
        local_checkpoint_every_steps=self.local_checkpoint_every_steps)
    # Its TensorBoard scalars would bring back a backup_dir deleted at the end.
    self._goodput = goodput.Recorder(self.backup_dir, chief=self.manager.worker_index == 0,
                                     tensorboard=not self.delete_checkpoint)

  def restore(self, model: keras.Model | None = None) -> int | None:
    """Restores the newest intact backup into the model; returns its step, or None.

    Every worker must call it. A corrupt backup is set aside (with a
    warning) and the previous one, if any, is used. `model.fit` calls it at
    its start; `tfdp.fit` calls it once, before it makes the dataset.
    """
    model = model or self.model
    self._ensure_manager(model)
    self._epoch.assign(-1)
    self._step_in_epoch.assign(-1)
    self._data_topology.assign([0, 0])
    self._data.restored = None

    def check(prefix):
      for diff in state_lib.check_checkpoint(self.state, prefix, self.allow_config_mismatch):
        logging.warning("Resuming despite a config mismatch: %s (%s)", diff, prefix)

    start = time.perf_counter()
    with model.distribute_strategy.scope():
      prefix = self.manager.restore_newest_intact(before_restore=check)
    seconds = time.perf_counter() - start
    if prefix is None:
      self.restored_step = None
      self._goodput.restored(None, seconds)
      return None
    self.restored_step = self.state.step
    self._goodput.restored(self.restored_step, seconds, self.manager.restored_tier)
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
      start = time.perf_counter()
      self.manager.save(checkpoint_number=step, metrics=self._metrics)
      self._goodput.blocked(time.perf_counter() - start, "persistent")
    return self.manager.latest_checkpoint

  def note_metrics(self, metrics: dict) -> None:
    """Metrics (name -> number) stored with the next backups, for `keep_best`."""
    for name, value in metrics.items():
      try:
        self._metrics[str(name)] = float(value)
      except (TypeError, ValueError):
        pass  # Not a number (e.g. a learning-rate schedule's config).

  def _resume_data(self):
    """Puts the restored data position into this fit's input (after restore)."""
    run = fit_hooks.current(self.model)
    position, self._data.restored = self._data.restored, None
    if run is None or self.restored_step is None:
      return
    steps = int(self._step_in_epoch.numpy())
    saved = [int(v) for v in self._data_topology.numpy()]
    now = _topology(self.model.distribute_strategy)
    if saved[0] and saved != now:
      message = (f"the backup in {self.backup_dir} holds the data positions of "
                 f"{saved[0]} worker(s) with {saved[1]} replica(s) in all, this job "
                 f"has {now[0]} with {now[1]}; a data position cannot be split over "
                 "another topology")
      if not self.restart_epoch_data:
        raise errors.ConfigError(
            f"{message}. Resume with the same number of workers and replicas, use "
            "a tfdp.data source with tfdp.fit (topology-independent), or pass "
            "BackupAndRestore(..., restart_epoch_data=True) to restart the "
            "interrupted epoch's data.")
      logging.warning("tfdp: %s; restarting the interrupted epoch's data.", message)
      return
    if run.dataset is None or not saved[0] or position is None or (
        position["kind"] == b"none") or steps < 0:
      reason = (run.not_saved_reason if run.dataset is None else
                "the backup holds no data position (an older backup, or an input "
                "tf.data could not save)")
      logging.warning("tfdp: %s; the interrupted epoch restarts from its first batch.",
                      reason)
      return
    run.dataset.set_pending(position["state"] if position["kind"] == b"iterator" else None,
                            int(position["made"]))
    run.skip_steps(steps)
    logging.info("Resuming the data at step %d of epoch %d.", steps, int(self._epoch.numpy()))

  def _save_for_preemption(self, step):
    _save_if_due(self.manager, self._decision, step, self._previous, self._metrics,
                 self._goodput, preempted=True)
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
      self._resume_data()
      self._preempted = False
      if self._preemption is not None:
        self._preemption.handler.install()
    self._ensure_manager(self.model)
    run = fit_hooks.current(self.model)
    self._data_topology.assign(
        _topology(self.model.distribute_strategy) if run is not None and run.dataset is not None
        else [0, 0])
    self._previous = _iterations(self.model)

  def on_train_batch_end(self, batch, logs=None):
    self._step_in_epoch.assign(batch + 1)
    step = _iterations(self.model)
    _save_if_due(self.manager, self._decision, step, self._previous, self._metrics,
                 self._goodput)
    if self._local_decision.should_save(policy_lib.SaveContext(
        step=step, previous_step=self._previous)):
      start = time.perf_counter()
      self.manager.save_local(step)
      self._goodput.blocked(time.perf_counter() - start, "local")
    self._goodput.step(step)
    self._previous = step
    if self._preemption is not None:
      self._preemption.on_train_batch_end(batch, logs)

  def on_epoch_end(self, epoch, logs=None):
    self._epoch.assign(epoch + 1)
    self._step_in_epoch.assign(0)
    self.note_metrics(logs or {})
    _save_if_due(self.manager, self._decision, _iterations(self.model), self._previous,
                 self._metrics, self._goodput, epoch_end=True)

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
    step = _iterations(model)
    _save_if_due(self.manager, self._decision, step, self._previous,
                 self._metrics, self._goodput, train_end=True)
    self.manager.close()  # Waits for the last save; releases the directory.
    self.manager.drop_local()  # The persistent tier holds the end.
    if not self.delete_checkpoint:
      self._goodput.finished(step)
      return  # A later save takes the directory again.
    # Every worker has returned from its last save before the chief deletes
    # the directory: a worker still waiting for that save's commit would
    # otherwise wait for a manifest that no longer exists.
    cluster.agree(0.0, "max", model.distribute_strategy)
    manager, self.manager = self.manager, None
    if manager.worker_index == 0 and tf.io.gfile.exists(self.backup_dir):
      tf.io.gfile.rmtree(self.backup_dir)
    self._goodput.finished(step)


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
