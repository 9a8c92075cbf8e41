"""CheckpointManager: tf.train.CheckpointManager's API over sharded, atomic, verified, optionally async saves."""

import functools
import os
import time
import warnings

from absl import logging
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.checkpoint.persistent import catalog as catalog_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.persistent import lease as lease_lib
from tfdp.checkpoint.local import options as local_options_lib
from tfdp.checkpoint import recovery
from tfdp.checkpoint import restorer as restorer_lib
from tfdp.checkpoint.persistent import retention
from tfdp.checkpoint import tiers as tiers_lib
from tfdp.checkpoint.persistent import session as session_lib
from tfdp.checkpoint.persistent import writer as storage


def _local_property(get, doc, default=None):
  """A read-only property of the manager's local tier: `get(tier)`, or `default` without one."""
  return property(lambda self: default if self._local is None else get(self._local), doc=doc)


def _tiers_method(method):
  """A method of the manager that is its `Tiers`' (the same name, arguments and docstring)."""
  @functools.wraps(method)
  def call(self, *args, **kwargs):
    return method(self._tiers, *args, **kwargs)
  return call


class CheckpointManager:
  """A drop-in `tf.train.CheckpointManager` that saves sharded across workers.

  TF 2.21's arguments, methods and properties, with the same files on disk,
  `checkpoints`, `latest_checkpoint`, `checkpoint` state file, numbering,
  interval and retention; checkpoints TF wrote in the directory (listed in
  its `checkpoint` file) are listed, restored and retained too. Every worker
  must construct it and call `save()` the same number of times: each writes
  a disjoint, byte-balanced part, the chief merges them into one standard TF
  checkpoint and commits it by writing `<name>-<n>.manifest.json` last.
  Workers coordinate through the file system only, so an async save issues
  no collective.

  On purpose unlike TF's: with `async_save=True`, dropped checkpoints are
  deleted in the background after the commit (a synchronous save has
  deleted them when it returns, as TF's); a number already committed, or
  below the newest, is refused; the chief leases the directory, so a second
  job writing there is refused (see tfdp.checkpoint.persistent.lease).

  Per-worker state (`per_worker`: name -> trackable whose values differ
  between workers) is saved by worker i under `_tfdp_per_worker/<i>/<key>`
  and restored by it; workers without any in the checkpoint keep their
  values (with a warning): `load_per_worker(path)` reshards it.

  Args:
    checkpoint: the `tf.train.Checkpoint` to save (identical on every worker).
    directory: where checkpoints go (local path or any tf.io.gfile URL; all
      workers must see the same directory).
    max_to_keep: keep the newest N (None: all).
    keep_checkpoint_every_n_hours: a checkpoint dropped by max_to_keep is
      kept on disk (and no longer listed) when it is at least this many hours
      newer than the last one so kept, as in TF.
    checkpoint_name: file prefix (default "ckpt").
    step_counter, checkpoint_interval: with both, save() skips unless
      `checkpoint_interval` steps have passed since the last save or restore.
    init_fn: called by restore_or_initialize() when there is no checkpoint.
    last_checkpoint_step: the step of the last save, for the interval.
    keep_best: also keep the best K by a metric passed to save(metrics=...):
      `(metric, "min"|"max", K)`, e.g. `("val_loss", "min", 3)`, or the
      string "val_loss:min:3".
    async_save: save() blocks only to copy the state to host memory; files
      are written by a background thread.
    max_shard_bytes: cap on each data file a worker writes.
    per_worker: dict name -> trackable of per-worker state (see above).
    worker_index, num_workers: override what the cluster says.
    strategy: the MultiWorkerMirroredStrategy (default: the one in scope, or
      the one owning `checkpoint`'s variables; see tfdp.distribute.cluster.resolve).
    run_id: an id shared by all workers and new for each job attempt; needed
      only with explicit worker_index/num_workers > 1 (default: env
      TFDP_RUN_ID). With a strategy, the workers agree on one by themselves.
    global_batch_size: recorded in the manifest.
    commit_timeout: seconds the chief waits for the other workers' shards.
    verify_on_restore: check file sizes before restoring.
    keep_every_n_hours: deprecated name of keep_checkpoint_every_n_hours.
    local_checkpoint_dir: the local tier: a per-host directory (default,
      with local_checkpoint_every_steps: under /dev/shm) of whole copies of
      the state, saved by `save_local()` in the background (docs/tiers.md).
    local_checkpoint_every_steps: how often the training loop saves locally
      (asked by `save_at_step`, tfdp.callbacks', by `save()` with a
      `step_counter`, or through `local_due(step)`): an int N (whenever the
      step reaches or crosses a multiple of N), or "auto": as often as
      `checkpoint_overhead` allows, down to every step, measured as training
      goes and agreed by the workers.
    checkpoint_overhead: with "auto", the share of the training time the
      local saves may cost (blocked time plus their writer's CPU).
    local_options: the three above as one `tfdp.checkpoint.local.options.LocalOptions`.

  Raises:
    ConfigError: a bad argument, or a cluster without a strategy.
    CheckpointError: another job writes into `directory`.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, directory: str,
               max_to_keep: int | None = 5,
               keep_checkpoint_every_n_hours: float | None = None,
               checkpoint_name: str = "ckpt", step_counter=None,
               checkpoint_interval: int | None = None, init_fn=None,
               last_checkpoint_step: int | None = None, *,
               keep_best=None, async_save: bool = False,
               max_shard_bytes: int | None = None, per_worker: dict | None = None,
               worker_index: int | None = None, num_workers: int | None = None,
               strategy=None, run_id: str | None = None,
               global_batch_size: int | None = None, commit_timeout: float = 300.0,
               verify_on_restore: bool = True, keep_every_n_hours: float | None = None,
               local_checkpoint_dir: str | None = None,
               local_checkpoint_every_steps: int | str | None = None,
               checkpoint_overhead: float = local_options_lib.DEFAULT_OVERHEAD,
               local_options: local_options_lib.LocalOptions | None = None):
    if not isinstance(checkpoint, tf.train.Checkpoint):
      raise errors.ConfigError(
          f"checkpoint must be a tf.train.Checkpoint, got {type(checkpoint)}; "
          "wrap your objects: tf.train.Checkpoint(model=model, ...).")
    if keep_every_n_hours is not None:
      warnings.warn("keep_every_n_hours is deprecated; pass "
                    "keep_checkpoint_every_n_hours (tf.train.CheckpointManager's "
                    "name).", DeprecationWarning, stacklevel=2)
      keep_checkpoint_every_n_hours = keep_every_n_hours
    if checkpoint_interval is not None and step_counter is None:
      raise errors.ConfigError(
          "`step_counter` should be passed if `checkpoint_interval` is not None.")
    if max_shard_bytes is not None and max_shard_bytes < 1:
      raise errors.ConfigError(
          f"max_shard_bytes={max_shard_bytes}: pass a positive byte count.")
    local_options = local_options or local_options_lib.LocalOptions(
        local_checkpoint_every_steps, checkpoint_overhead, local_checkpoint_dir)
    keep, hours = retention.policies(max_to_keep, keep_best, keep_checkpoint_every_n_hours)
    self._checkpoint = checkpoint
    self._directory = fs.require_directory(os.fspath(directory).rstrip("/"))
    self._layout = layout_lib.Layout(self._directory, checkpoint_name)
    self._checkpoint_interval = checkpoint_interval
    timeout = float(commit_timeout)
    self._init_fn = init_fn
    self._me = cluster.resolve(strategy, objects=checkpoint, worker_index=worker_index,
                               num_workers=num_workers)
    self._per_worker = items_lib.PerWorker(per_worker, self._me.index)
    self._local = local_options.tier(self._layout, self._me, timeout)
    started = session_lib.start(self._me, self._layout, run_id, timeout,
                                tiers=self._local is not None)
    if started.own is not None:  # A non-chief given a directory of its own writes into the chief's.
      self._layout, self._directory = started.layout, started.layout.directory
      self._local = local_options.tier(self._layout, self._me, timeout)
    self._started = started
    self._lease = lease_lib.Holder(self._layout.lease_path, started.id, self._directory,
                                   started.lease)
    if self._local is not None:
      self._local.start(started.token, started.id)
      self._local.connect()
    self._catalog = catalog_lib.read(self._layout, time.time())
    self._persistent = tiers_lib.PersistentSaves(
        checkpoint, self._layout, self._catalog, self._me, self._per_worker, self._lease,
        started.id, keep=keep, hours=hours, async_save=async_save,
        max_shard_bytes=max_shard_bytes, global_batch_size=global_batch_size,
        timeout=timeout)
    self._writer = self._persistent.writer  # The persistent saves' background thread.
    # The two tiers this manager holds; a save's snapshot goes to those due from one place.
    self._tiers = tiers_lib.Tiers(checkpoint, self._per_worker, self._persistent, self._local,
                                  step_counter, checkpoint_interval, last_checkpoint_step,
                                  started.keep_own)
    self._restorer = restorer_lib.Restorer(checkpoint, self._layout, self._catalog, self._me,
                                          self._per_worker.checkpoint, verify_on_restore,
                                          self._lease)
    self.restored_tier = None

  # -- tf.train.CheckpointManager's API --

  @property
  def directory(self) -> str:
    return self._directory

  @property
  def checkpoint(self) -> tf.train.Checkpoint:
    return self._checkpoint

  @property
  def checkpoint_interval(self) -> int | None:
    return self._checkpoint_interval

  @property
  def checkpoints(self) -> list[str]:
    """Prefixes of the managed checkpoints, oldest first (hours-kept ones are not listed, as in TF)."""
    return self._catalog.prefixes()

  @property
  def latest_checkpoint(self) -> str | None:
    """Prefix of the newest committed checkpoint, or None."""
    return self._catalog.newest()

  @property
  def last_saved_step(self) -> int | None:
    """The step of the newest checkpoint this manager saved or restored, or None."""
    return self._tiers.last_saved_step

  _gather = property(lambda self: self._tiers.gather,  # The tiers' traced reads (tests count them).
                     lambda self, gather: setattr(self._tiers, "gather", gather))
  worker_index = property(lambda self: self._me.index, doc="This worker's index.")
  num_workers = property(lambda self: self._me.count, doc="Number of workers.")
  is_chief = property(lambda self: self._me.is_chief, doc="Whether this worker is the chief.")

  # -- the local tier (tfdp.checkpoint.tiers.Tiers; None, 0 and [] without one) --

  local_checkpoint_every_steps = _local_property(
      lambda t: t.every_steps,
      "How often the training loop saves to the local tier (an int, 'auto' or None).")
  local_interval = _local_property(lambda t: t.interval,
                                   "The steps between local saves now (with 'auto': agreed).")
  local_tuning = _local_property(
      lambda t: t.cadence.tuning,
      "With 'auto': the measurement behind the interval now "
      "(tfdp.checkpoint.schedule.policy.Tuning), or None before the first.")
  local_directory = _local_property(lambda t: t.layout.directory,
                                    "This worker's local-tier directory.")
  local_saves_skipped = _local_property(
      lambda t: t.skipped,
      "Local saves never written: a newer one came while they waited for the previous one.",
      default=0)
  local_due = _tiers_method(tiers_lib.Tiers.local_due)
  local_checkpoints = _tiers_method(tiers_lib.Tiers.local_checkpoints)
  save_local = _tiers_method(tiers_lib.Tiers.save_local)
  save_at_step = _tiers_method(tiers_lib.Tiers.save_at_step)
  drop_local = _tiers_method(tiers_lib.Tiers.drop_local)

  def save(self, checkpoint_number=None, check_interval: bool = True, options=None,
           *, metrics: dict | None = None) -> str | None:
    """Saves a checkpoint; every worker must call it.

    Args:
      checkpoint_number: number of the checkpoint (default: the checkpoint's
        incremented `save_counter`, which is incremented either way, as TF;
        a save that fails gives its increment back).
      check_interval: honour `checkpoint_interval` (when set); a save at the
        step of the last one is skipped either way.
      options: a `tf.train.CheckpointOptions`; its experimental_write_callbacks
        are called with the prefix once committed. tfdp writes on the host.
      metrics: dict name -> float stored in the manifest (for keep_best).

    Returns:
      The prefix, or None when skipped by the interval. In async mode the
      checkpoint is committed later (see sync()). A `checkpoint_number` of
      the newest checkpoint, saved at this step (a custom loop's every-N
      save landing on its epoch's end), is not saved again: its prefix is
      returned (with a debug line).

    Raises:
      CheckpointError: the save (or the previous async one) failed, or a
        checkpoint with this number (of another step) or a higher one is
        already committed.
    """
    self._persistent.wait()
    self._started.keep_own()
    step, persistent, local = self._tiers.decide(check_interval)
    return self._tiers.save((step, checkpoint_number, metrics, options) if persistent else None,
                            step if local else None)

  def restore(self, save_path: str | None = None, *, allow_partial_restore: bool = False,
              require_all: bool = False):
    """Verifies and restores checkpoint `save_path` (default: the latest).

    Args:
      save_path: the checkpoint's prefix.
      allow_partial_restore, require_all: as `restore_newest_intact`'s.

    Returns:
      The load status of `tf.train.Checkpoint.restore` (None after a
      partial restore).

    Raises:
      CorruptCheckpointError: a file is missing, truncated or corrupt (the
        checkpoint is then set aside).
      IncompatibleCheckpointError: a checkpoint of another model (nothing
        is assigned).
    """
    self._persistent.wait()
    self._restorer.allow_partial, self._restorer.require_all = allow_partial_restore, require_all
    save_path = save_path or self.latest_checkpoint
    if save_path is None:
      raise errors.CheckpointError(
          f"No committed checkpoint in {self._directory} to restore.")
    status, man = self._restorer.restore(save_path)
    self._tiers.restored(save_path, man, "persistent")
    return status

  def restore_newest_intact(self, before_restore=None, *, allow_partial_restore: bool = False,
                            require_all: bool = False) -> str | None:
    """Restores the newest intact checkpoint; returns its prefix, or None.

    Every worker must call it, and all restore the same step. With a local
    tier, the newest state any worker can have (see
    tfdp.checkpoint.recovery); then the persistent checkpoints, newest
    first. Every candidate's file sizes are checked before anything is read
    (and before `before_restore`); when any worker cannot restore one, all
    move on to the next older one together (a broken one is set aside, with
    a warning naming the file). Local copies newer than what was restored
    are then deleted on every worker.

    A checkpoint of another model (a tensor of the checkpoint's objects it
    lacks, or holds with another dtype or shape) is refused before anything
    is assigned, on every worker, unless `allow_partial_restore` (as
    `tf.train.Checkpoint.restore(...).expect_partial()` and Keras's
    `skip_mismatch`): then what matches is restored and the chief logs the
    rest.

    Args:
      before_restore: optional `fn(prefix)` called before each restore, e.g.
        to refuse a checkpoint of another run; its exceptions propagate.
      allow_partial_restore: restore what matches of a checkpoint of
        another model, keeping the other objects' values.
      require_all: a tensor the checkpoint holds that no object saves (a
        removed layer) is a difference too. Leave it off when objects are
        made after the restore (an optimizer's slots before its first
        step), which TF restores as they are made.

    Raises:
      CheckpointError: nothing to restore, but the directory holds
        checkpoints neither TF's state file nor tfdp accounts for (rather
        than start over next to them).
      IncompatibleCheckpointError: the newest checkpoint is of another
        model (see above).
    """
    self._persistent.wait()
    self._restorer.allow_partial, self._restorer.require_all = allow_partial_restore, require_all
    found = recovery.restore_newest(self._checkpoint, self._local, self._me, self._restorer,
                                    before_restore)
    self.restored_tier = found.tier if found else None
    if found is not None:
      self._tiers.restored(found.prefix, found.manifest, found.tier)
    return found.prefix if found else None

  def restore_or_initialize(self) -> str | None:
    """Restores the newest intact checkpoint, or runs init_fn when there is none.

    Returns:
      The restored prefix, or None when initialized.
    """
    prefix = self.restore_newest_intact()
    if prefix is None and self._init_fn is not None:
      self._init_fn()
      logging.info("Customized initialization is done through the passed `init_fn`.")
    return prefix

  def sync(self) -> None:
    """Waits for the background saves (and their deletions); re-raises a persistent save's error."""
    if self._local is not None:
      self._local.wait()
    self._persistent.wait()

  wait_until_finished = sync

  def close(self) -> None:
    """Waits for the background saves, releases the directory and ends the local tier's side channel.

    A later save takes the directory again; local saves after close() keep
    their copies but send nothing to the other workers.
    """
    try:
      self.sync()
    finally:
      self._lease.release()
      if self._local is not None:
        self._local.close()

  def delete_directory(self) -> None:
    """Deletes the checkpoint directory and all in it (the chief; e.g. a finished backup).

    Every worker must have returned from its last save first.
    """
    self.close()
    if self._me.is_chief:
      storage.remove_directory(self._layout)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      if not self._writer.running():
        self._lease.release()
    except Exception:  # pylint: disable=broad-except
      pass
