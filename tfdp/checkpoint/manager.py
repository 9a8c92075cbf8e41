"""CheckpointManager: tf.train.CheckpointManager's API over sharded, atomic, verified, optionally async saves."""

import os
import threading
import time
import warnings

from absl import logging
import keras
import tensorflow as tf

import tfdp
from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import async_writer
from tfdp.checkpoint import catalog as catalog_lib
from tfdp.checkpoint import fs
from tfdp.checkpoint import items as items_lib
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import lease as lease_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import planner
from tfdp.checkpoint import policy
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import retention
from tfdp.checkpoint import session as session_lib
from tfdp.checkpoint import storage



def _number(value):
  if isinstance(value, (tf.Variable, tf.Tensor)):
    value = value.numpy()
  return int(value)


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
  job writing there is refused (see tfdp.checkpoint.lease).

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
      `(metric, "min"|"max", K)`, e.g. `("val_loss", "min", 3)`.
    async_save: save() blocks only to copy the state to host memory; files
      are written by a background thread.
    max_shard_bytes: cap on each data file a worker writes.
    per_worker: dict name -> trackable of per-worker state (see above).
    worker_index, num_workers: override what the cluster says.
    strategy: the MultiWorkerMirroredStrategy (default: the one in scope, or
      the one owning `checkpoint`'s variables; see tfdp.cluster.resolve).
    run_id: an id shared by all workers and new for each job attempt; needed
      only with explicit worker_index/num_workers > 1 (default: env
      TFDP_RUN_ID). With a strategy, the workers agree on one by themselves.
    global_batch_size: recorded in the manifest.
    commit_timeout: seconds the chief waits for the other workers' shards.
    verify_on_restore: check file sizes before restoring.
    keep_every_n_hours: deprecated name of keep_checkpoint_every_n_hours.

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
               verify_on_restore: bool = True, keep_every_n_hours: float | None = None):
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
    policies = [retention.KeepLatest(max_to_keep)]
    if keep_best is not None:
      policies.append(retention.parse_keep_best(keep_best))
    self._keep = retention.AnyOf(tuple(policies))
    self._hours = retention.KeepEveryNHours(keep_checkpoint_every_n_hours)
    self._checkpoint = checkpoint
    self._directory = os.fspath(directory).rstrip("/")
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
    self._verify = verify_on_restore
    self._init_fn = init_fn
    self._per_worker = dict(per_worker or {})
    self._per_worker_ckpt = (tf.train.Checkpoint(**self._per_worker)
                             if self._per_worker else None)
    self._me = cluster.resolve(strategy, objects=checkpoint, worker_index=worker_index,
                               num_workers=num_workers)
    self._lock = threading.Lock()
    self._writer = async_writer.AsyncWriter()
    self._seq = 0
    self._renewer = None
    self._session, lease = session_lib.start(self._me, self._layout, run_id, self._timeout)
    if lease is not None:
      self._renewer = lease_lib.Renewer(self._layout.lease_path, lease, self)
    self._catalog = catalog_lib.read(self._layout, time.time())

  def _acquire(self, session):
    lease = lease_lib.acquire(self._layout.lease_path, session, self._directory)
    self._renewer = lease_lib.Renewer(self._layout.lease_path, lease, self)

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
    with self._lock:
      return [e.prefix for e in self._catalog.managed]

  @property
  def latest_checkpoint(self) -> str | None:
    """Prefix of the newest committed checkpoint, or None."""
    with self._lock:
      return self._catalog.latest

  @property
  def last_saved_step(self) -> int | None:
    """The step of the newest checkpoint this manager saved or restored, or None."""
    return self._last_saved_step

  worker_index = property(lambda self: self._me.index, doc="This worker's index.")
  num_workers = property(lambda self: self._me.count, doc="Number of workers.")

  def save(self, checkpoint_number=None, check_interval: bool = True, options=None,
           *, metrics: dict | None = None) -> str | None:
    """Saves a checkpoint; every worker must call it.

    Args:
      checkpoint_number: number of the checkpoint (default: the checkpoint's
        incremented `save_counter`, which is incremented either way, as TF).
      check_interval: honour `checkpoint_interval` (when set); a save at the
        step of the last one is skipped either way.
      options: a `tf.train.CheckpointOptions`; its experimental_write_callbacks
        are called with the prefix once committed. tfdp writes on the host.
      metrics: dict name -> float stored in the manifest (for keep_best).

    Returns:
      The prefix, or None when skipped by the interval. In async mode the
      checkpoint is committed later (see sync()).

    Raises:
      CheckpointError: the save (or the previous async one) failed, or a
        checkpoint with this number or a higher one is already committed.
    """
    self._writer.wait()
    step = self._decide(check_interval)
    if step is False:
      return None
    number, prefix = self._number(checkpoint_number)
    meta = manifest_lib.SaveMeta(
        checkpoint_number=number, step=number if step is None else step,
        metrics={str(k): float(v) for k, v in (metrics or {}).items()},
        global_batch_size=self._global_batch_size,
        per_worker_keys=sorted(self._per_worker),
        versions={"tfdp": tfdp.__version__, "tensorflow": tf.__version__,
                  "keras": keras.__version__})
    sweep = self._plan_retention(prefix, meta)
    plan = self._plan()
    if self._me.is_chief and self._renewer is None:  # Released by close().
      self._acquire(self._session)
    self._seq += 1
    save_id = f"{self._session}-{self._seq:06d}"
    job = storage.SaveJob(
        layout=self._layout, prefix=prefix,
        tmp_dir=self._layout.tmp_dir(save_id, number), save_id=save_id, worker=self._me.index, num_workers=self._me.count,
        files=plan.for_worker(self._me.index), timeout=self._timeout, meta=meta,
        kept=tuple(os.path.basename(e.prefix) for e in sweep.kept))
    self._last_saved_step = meta.step
    if step is not None:
      self._last_checkpoint_step = step
    callbacks = list(getattr(options, "experimental_write_callbacks", None) or [])
    if self._async:
      self._writer.submit(lambda: self._run(job, sweep, callbacks))
    else:
      self._run(job, sweep, callbacks)
    return prefix

  def restore(self, save_path: str | None = None):
    """Verifies and restores checkpoint `save_path` (default: the latest).

    Returns:
      The load status of `tf.train.Checkpoint.restore`.

    Raises:
      CorruptCheckpointError: a file is missing, truncated or corrupt (the
        checkpoint is then set aside).
    """
    self._writer.wait()
    save_path = save_path or self.latest_checkpoint
    if save_path is None:
      raise errors.CheckpointError(
          f"No committed checkpoint in {self._directory} to restore.")
    man = self._manifest(save_path)
    try:
      if self._verify:
        restore_lib.check_sizes(save_path, man)
      status = restore_lib.restore_verified(self._checkpoint, save_path, man)
    except errors.CorruptCheckpointError as e:
      raise self._set_aside(save_path, e) from e
    if self._per_worker_ckpt is not None:
      restore_lib.restore_per_worker(self._per_worker_ckpt, save_path, self._me.index, man)
    self._restored(save_path, man)
    return status

  def restore_newest_intact(self, before_restore=None) -> str | None:
    """Restores the newest intact checkpoint; returns its prefix, or None.

    Every candidate's file sizes are checked before anything is read (and
    before `before_restore`); a broken one is set aside with a warning naming
    the file, and the next older one is tried.

    Args:
      before_restore: optional `fn(prefix)` called before each restore, e.g.
        to refuse a checkpoint of another run; its exceptions propagate.
    """
    self._writer.wait()
    with self._lock:
      candidates = self._catalog.candidates()
    for prefix in candidates:
      man = self._manifest(prefix)
      try:
        if self._verify:
          try:
            restore_lib.check_sizes(prefix, man)
          except errors.CorruptCheckpointError as e:
            raise self._set_aside(prefix, e) from e
        if before_restore is not None:
          before_restore(prefix)
        self.restore(prefix)
        return prefix
      except errors.CorruptCheckpointError as e:
        logging.warning("tfdp: Skipping a corrupt checkpoint: %s", e)
    return None

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
    """Waits for the background save (and its deletions); re-raises its error."""
    self._writer.wait()

  wait_until_finished = sync

  def close(self) -> None:
    """Waits for the background save and releases the directory; a later save takes it again."""
    try:
      self._writer.wait()
    finally:
      if self._renewer is not None:
        self._renewer.stop()
        self._renewer = None
        lease_lib.release(self._layout.lease_path, self._session)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      if self._renewer is not None and not self._writer.running():
        self._renewer.stop()
        lease_lib.release(self._layout.lease_path, self._session)
    except Exception:  # pylint: disable=broad-except
      pass

  # -- the steps of a save --

  def _decide(self, check_interval):
    """The step to record (None without a step counter), or False to skip (TF's interval rule)."""
    if self._interval is None:
      return None
    step = _number(self._step_counter)
    last = self._last_checkpoint_step
    if last is not None and step == last:
      return False
    ctx = policy.SaveContext(step=step, last_saved_step=last)
    if check_interval and not self._interval.should_save(ctx):
      return False
    return step

  def _number(self, checkpoint_number):
    """The number and prefix of the next checkpoint; increments save_counter once they are valid."""
    counter = self._checkpoint.save_counter
    number = (_number(counter) + 1 if checkpoint_number is None
              else _number(checkpoint_number))
    prefix = self._layout.prefix(number)
    if fs.exists(layout_lib.manifest_path(prefix)):
      raise errors.CheckpointError(
          f"Checkpoint {prefix} already exists; it is not overwritten. Save "
          "under another number, or train into a new directory.")
    latest = self.latest_checkpoint
    newest = layout_lib.number_of(latest) if latest else None
    if newest is not None and number < newest:
      # Retention and latest_checkpoint go by number: a lower one would be
      # dropped as the oldest at once, and a restart would resume the other.
      raise errors.CheckpointError(
          f"Checkpoint {prefix} would be older than {os.path.basename(latest)}, "
          f"already in {self._directory}. Restore the newest checkpoint "
          "before training on (restore_or_initialize()), train into a new "
          "directory, or delete the newer checkpoints to roll back.")
    counter.assign_add(1)
    return number, prefix

  def _plan_retention(self, prefix, meta):
    """What to keep once this save commits: decided before it starts."""
    new = retention.Entry(prefix, meta.checkpoint_number, time.time(), meta.metrics)
    with self._lock:
      entries = [e for e in self._catalog.managed if e.prefix != prefix] + [new]
      last_preserved = self._catalog.last_preserved
    return retention.sweep(entries, self._keep, self._hours, last_preserved)

  def _plan(self):
    local = None
    if self._per_worker_ckpt is not None:
      local = {self._me.index: items_lib.gather(
          self._per_worker_ckpt, layout_lib.per_worker_prefix(self._me.index),
          with_object_graph=False)}
    plan = planner.plan_save(items_lib.gather(self._checkpoint), self._me.count,
                             max_shard_bytes=self._max_shard_bytes, local_items=local)
    if self._async:
      files = tuple(tuple(items_lib.snapshot(list(f))) for f in plan.files[self._me.index])
      plan = planner.SavePlan(plan.files[:self._me.index] + (files,)
                              + plan.files[self._me.index + 1:])
    return plan

  def _run(self, job, sweep, callbacks):
    """Runs the job, then this manager's after-commit step (in the writer's thread when async)."""
    man = storage.run(job)
    self._after_commit(job.prefix, man, sweep)
    for fn in callbacks:
      fn(job.prefix)

  def _after_commit(self, prefix, man, sweep):
    """Applies the retention decided before the save; the chief records and deletes."""
    kept = set(man.kept or [man.prefix])
    new = retention.Entry(prefix, man.checkpoint_number, man.time, man.metrics)
    managed = [new if e.prefix == prefix else e for e in sweep.kept]
    with self._lock:
      self._catalog.managed = [e for e in managed if os.path.basename(e.prefix) in kept]
      self._catalog.latest = prefix
      self._catalog.last_preserved = sweep.last_preserved
      self._catalog.manifests[man.prefix] = man
      for e in sweep.preserved + sweep.deleted:
        self._catalog.manifests.pop(os.path.basename(e.prefix), None)
    if not self._me.is_chief:
      return
    catalog_lib.write_state(self._layout, self._catalog)
    for e in sweep.deleted:
      storage.delete(self._layout, e.prefix)

  # -- restore helpers --

  def _manifest(self, prefix):
    with self._lock:
      man = self._catalog.manifests.get(os.path.basename(prefix))
    return man if man is not None else manifest_lib.read_manifest(prefix)

  def _restored(self, prefix, man):
    if self._interval is not None:
      self._last_checkpoint_step = _number(self._step_counter)
      self._last_saved_step = self._last_checkpoint_step
    else:
      self._last_saved_step = man.step if man is not None else layout_lib.number_of(prefix)

  def _set_aside(self, prefix, error):
    """Takes corrupt checkpoint `prefix` out of the managed ones; returns the error to raise.

    Its manifest becomes `<prefix>.manifest.json.corrupt` (a marker when it
    has none), so a restart does not try it again and training can save past
    its number; its data files go with the next manager's cleanup.
    """
    with self._lock:
      if prefix not in self._catalog.candidates():
        return error
      self._catalog.drop(prefix)
      latest = self._catalog.latest
    aside = layout_lib.corrupt_path(prefix)
    if self._me.is_chief:
      try:
        if self._renewer is None:
          self._acquire(self._session)
        storage.set_aside(prefix, str(error))
        catalog_lib.write_state(self._layout, self._catalog)
      except tf.errors.OpError as e:
        logging.warning("tfdp: could not set aside %s: %s", prefix, e)
    return errors.CorruptCheckpointError(
        f"{error} It is no longer a committed checkpoint (set aside as "
        f"{aside}); the newest intact one is {latest}.")
