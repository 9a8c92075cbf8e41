"""CheckpointManager: tf.train.CheckpointManager's API over sharded, atomic, verified, optionally async saves."""

import os
import time
import warnings

from absl import logging
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.checkpoint import async_writer
from tfdp.checkpoint.persistent import catalog as catalog_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.persistent import lease as lease_lib
from tfdp.checkpoint.local import tier as local_lib
from tfdp.checkpoint.local import face as local_face
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import planner
from tfdp.checkpoint import policy
from tfdp.checkpoint import recovery
from tfdp.checkpoint import restorer as restorer_lib
from tfdp.checkpoint.persistent import retention
from tfdp.checkpoint.persistent import session as session_lib
from tfdp.checkpoint.persistent import writer as storage


_number = items_lib.number


class CheckpointManager(local_face.LocalFace):
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
      (asked through `local_due(step)`, by tfdp.callbacks and by `save()`
      with a `step_counter`): an int N (whenever the step reaches or
      crosses a multiple of N), or "auto": as often as `checkpoint_overhead`
      allows, down to every step, measured as training goes and agreed by
      the workers.
    checkpoint_overhead: with "auto", the share of the training time the
      local saves may cost (blocked time plus their writer's CPU).

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
               checkpoint_overhead: float = local_lib.DEFAULT_OVERHEAD):
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
    self._keep, self._hours = retention.policies(max_to_keep, keep_best,
                                                 keep_checkpoint_every_n_hours)
    self._checkpoint = checkpoint
    self._directory = fs.require_directory(os.fspath(directory).rstrip("/"))
    self._layout = layout_lib.Layout(self._directory, checkpoint_name)
    self._async = async_save
    self._max_shard_bytes = max_shard_bytes
    self._step_counter = step_counter
    self._checkpoint_interval = checkpoint_interval
    self._interval = (policy.MinInterval(checkpoint_interval)
                      if checkpoint_interval is not None else None)
    self._last_checkpoint_step = last_checkpoint_step
    self._last_saved_step = None
    self._global_batch_size = global_batch_size
    self._timeout = float(commit_timeout)
    self._init_fn = init_fn
    self._me = cluster.resolve(strategy, objects=checkpoint, worker_index=worker_index,
                               num_workers=num_workers)
    self._per_worker = items_lib.PerWorker(per_worker, self._me.index)
    self._writer = async_writer.AsyncWriter()
    self._seq = 0
    self._uncommitted_count = None  # save_counter before a save not yet committed.
    self._gather = items_lib.CachedGather(checkpoint)
    self._taken = None  # (step, Items) a persistent save took, for the local save of its step.
    self._local = local_lib.make(self._layout, local_checkpoint_dir,
                                 local_checkpoint_every_steps, self._me, self._timeout,
                                 checkpoint_overhead)
    started = session_lib.start(self._me, self._layout, run_id, self._timeout,
                                tiers=self._local is not None)
    if started.own is not None:  # A non-chief given a directory of its own writes into the chief's.
      self._layout, self._directory = started.layout, started.layout.directory
      self._local = local_lib.make(self._layout, local_checkpoint_dir,
                                   local_checkpoint_every_steps, self._me, self._timeout,
                                   checkpoint_overhead)
    self._started = started
    self._session = started.id
    self._lease = lease_lib.Holder(self._layout.lease_path, started.id, self._directory,
                                   started.lease)
    if self._local is not None:
      self._local.start(started.token, started.id)
      self._local.connect()
    self._catalog = catalog_lib.read(self._layout, time.time())
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
    return self._last_saved_step

  worker_index = property(lambda self: self._me.index, doc="This worker's index.")
  num_workers = property(lambda self: self._me.count, doc="Number of workers.")
  is_chief = property(lambda self: self._me.is_chief, doc="Whether this worker is the chief.")

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
    self._wait()
    self._started.keep_own()
    step, persistent, local = self._decide(check_interval)
    if not persistent:
      return self._then_local(local, step, None)
    saved = self._saved_already(checkpoint_number, step)
    if saved is not None:
      logging.debug("tfdp: %s already holds step %s; not saved again.", saved, step)
      return self._then_local(local, step, saved)
    number, prefix = self._next_number(checkpoint_number)
    meta = self._meta(number, number if step is None else step, metrics)
    sweep = self._catalog.plan(prefix, number, meta.metrics, self._keep, self._hours)
    files = self._plan(meta.step)
    if self._me.is_chief:
      self._lease.ensure()  # Released by close().
    self._seq += 1
    save_id = f"{self._session}-{self._seq:06d}"
    job = storage.SaveJob(
        layout=self._layout, prefix=prefix, tmp_dir=self._layout.tmp_dir(save_id, number),
        save_id=save_id, session=self._session, worker=self._me.index,
        num_workers=self._me.count, files=files,
        timeout=self._timeout, meta=meta,
        kept=tuple(os.path.basename(e.prefix) for e in sweep.kept),
        fence=self._lease.check if self._me.is_chief else None)
    self._last_saved_step = meta.step
    if step is not None:
      self._last_checkpoint_step = step
    callbacks = list(getattr(options, "experimental_write_callbacks", None) or [])
    if self._async:
      self._writer.submit(lambda: self._run(job, sweep, callbacks))
    else:
      self._wait(lambda: self._run(job, sweep, callbacks))
    return self._then_local(local, step, prefix)

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
    self._wait()
    self._restorer.allow_partial, self._restorer.require_all = allow_partial_restore, require_all
    save_path = save_path or self.latest_checkpoint
    if save_path is None:
      raise errors.CheckpointError(
          f"No committed checkpoint in {self._directory} to restore.")
    status, man = self._restorer.restore(save_path)
    self._restored(save_path, man, "persistent")
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
    self._wait()
    self._restorer.allow_partial, self._restorer.require_all = allow_partial_restore, require_all
    found = recovery.restore_newest(self._checkpoint, self._local, self._me, self._restorer,
                                    before_restore)
    self.restored_tier = found.tier if found else None
    if found is not None:
      self._restored(found.prefix, found.manifest, found.tier)
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
    self._wait()

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

  # -- the steps of a save --

  def _decide(self, check_interval):
    """(the step counter's value or None, save persistently, save locally).

    TF's rule: with a `checkpoint_interval` the interval decides; without,
    every call saves. The step is the manifest's whenever there is a step
    counter. The local tier's cadence counts the step counter's.
    """
    step = None if self._step_counter is None else _number(self._step_counter)
    local = check_interval and step is not None and self.local_due(step)
    if self._interval is None:
      return step, True, local
    decision = policy.AnyOf((self._interval if check_interval else policy.Always(),))
    persistent = decision.should_save(policy.SaveContext(
        step=step, last_saved_step=self._last_checkpoint_step))
    return step, persistent, local

  def _saved_already(self, checkpoint_number, step):
    """The prefix of the newest checkpoint when `checkpoint_number` is its number and it holds this step; else None.

    The step is the step counter's: the same step is the same state. Without
    a step counter nothing tells a repeat of the saved state from a changed
    one at the same number, so the save is refused (catalog.check_new) rather
    than a changed state dropped.
    """
    if checkpoint_number is None or step is None:
      return None
    prefix = self._layout.prefix(_number(checkpoint_number))
    man = self._catalog.manifest(prefix) if prefix == self._catalog.newest() else None
    return prefix if man is not None and man.step == step else None

  def _next_number(self, checkpoint_number):
    """The number and prefix of the next checkpoint; increments save_counter once they are valid."""
    counter = self._checkpoint.save_counter
    before = _number(counter)
    number = before + 1 if checkpoint_number is None else _number(checkpoint_number)
    prefix = self._layout.prefix(number)
    self._catalog.check_new(prefix)
    counter.assign_add(1)
    self._uncommitted_count = before
    return number, prefix

  def _plan(self, step):
    """This worker's files of the save: a host snapshot of its part when async."""
    items = items_lib.gather(self._checkpoint)
    self._gather.check(items)
    own = self._per_worker.items()
    plan = planner.plan_save(items, self._me.count, max_shard_bytes=self._max_shard_bytes,
                             local_items={self._me.index: own})
    files = plan.for_worker(self._me.index)
    if self._local is not None:  # Until the local save of this step, or the next step's.
      self._taken = (step, items + own)
    return [items_lib.snapshot(f) for f in files] if self._async else files

  def _wait(self, run=None):
    """Waits for the background save (or runs `run` now); a failure gives back its save_counter increment."""
    try:
      self._writer.wait()
      if run is not None:
        run()
    except BaseException:
      if self._uncommitted_count is not None:
        self._checkpoint.save_counter.assign(self._uncommitted_count)
      self._uncommitted_count = None
      raise
    self._uncommitted_count = None

  def _run(self, job, sweep, callbacks):
    """Runs the job, then the commit's bookkeeping (in the writer's thread when async)."""
    storage.after_commit(self._layout, self._catalog, storage.run(job), job.prefix, sweep,
                         self._me.is_chief)
    for fn in callbacks:
      fn(job.prefix)

  def _meta(self, number, step, metrics, **extra):
    return manifest_lib.SaveMeta.new(number, step, metrics, self._global_batch_size,
                                     self._per_worker.keys, **extra)

  def _restored(self, prefix, man, tier):
    step = man.step if man is not None else layout_lib.number_of(prefix)
    self._last_saved_step = step
    if self._interval is not None:
      self._last_checkpoint_step = self._last_saved_step = _number(self._step_counter)
    if self._local is not None:  # What an abandoned attempt saved past it goes, on every worker.
      self._local.restored(step, tier)
