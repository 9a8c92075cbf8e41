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
from tfdp.checkpoint import tiers


# Outcomes of one worker's restore in the tiered protocol.
_OK = "ok"
_DAMAGED = "damaged"


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
    local_checkpoint_dir: the local tier: a per-host directory (default,
      with local_checkpoint_every_steps: under /dev/shm) where each worker
      keeps whole copies of the state, saved by `save_local()` in the
      background, the newest LOCAL_KEEP (2) kept. Restores then take the
      newest state any worker can have (see restore_newest_intact).
    local_checkpoint_every_steps: how often the training loop saves locally
      (read by callers: tfdp.callbacks, and `save()` with `step_counter`,
      which also saves locally whenever the step is a multiple of it).

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
               local_checkpoint_every_steps: int | None = None):
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
    self._local_writer = async_writer.AsyncWriter()
    self._seq = 0
    self._local_seq = 0
    self._local_gather = items_lib.CachedGather(checkpoint)
    self._renewer = None
    self._local = self._local_tier(local_checkpoint_dir, local_checkpoint_every_steps,
                                   checkpoint_name)
    self.restored_tier = None
    self.local_saves_skipped = 0
    if self._local is not None and self._me.is_chief:
      fs.makedirs(self._directory)
      token = tiers.ensure_token(self._layout)
    self._session, lease = session_lib.start(self._me, self._layout, run_id, self._timeout)
    if lease is not None:
      self._renewer = lease_lib.Renewer(self._layout.lease_path, lease, self)
    if self._local is not None:
      if not self._me.is_chief:
        token = tiers.read_token(self._layout, self._timeout)
      self._local.start(token, self._session)
    self._catalog = catalog_lib.read(self._layout, time.time())

  def _local_tier(self, directory, every_steps, name):
    if directory is None and not every_steps:
      return None
    if every_steps is not None and every_steps < 0:
      raise errors.ConfigError(
          f"local_checkpoint_every_steps={every_steps}: pass a positive number of steps.")
    if self._me.count > 1 and self._me.strategy is None:
      raise errors.ConfigError(
          "The local checkpoint tier needs a MultiWorkerMirroredStrategy with "
          f"{self._me.count} workers: the workers agree on the newest state and "
          "recover lost copies through its collectives. Build the manager under "
          "strategy.scope() or pass strategy=.")
    root = os.fspath(directory) if directory else tiers.default_local_dir(self._directory)
    return tiers.LocalTier(root, self._me.index, self._me.count, name, every_steps or None)

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

  @property
  def local_checkpoint_every_steps(self) -> int | None:
    """How often the training loop saves to the local tier (None: no local tier or no cadence)."""
    return self._local.every_steps if self._local is not None else None

  @property
  def local_directory(self) -> str | None:
    """This worker's local-tier directory, or None."""
    return self._local.layout.directory if self._local is not None else None

  def local_checkpoints(self) -> list[str]:
    """Prefixes of this worker's committed local checkpoints, oldest first."""
    return self._local.layout.committed() if self._local is not None else []

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
    if (self._local is not None and self._local.every_steps and check_interval
        and self._step_counter is not None):
      now = _number(self._step_counter)
      if policy.EveryNSteps(self._local.every_steps).should_save(policy.SaveContext(step=now)):
        self.save_local(now)
    step = self._decide(check_interval)
    if step is False:
      return None
    number, prefix = self._number(checkpoint_number)
    meta = self._meta(number, number if step is None else step, metrics)
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

  def save_local(self, step: int | None = None) -> str | None:
    """Saves a whole copy of the state to this worker's local tier, in the background.

    It blocks only to take the state (a host snapshot, as an async save);
    each worker writes its own copy without talking to the others, so the
    workers may call it at different steps. A save while the previous one
    is still being written is skipped (counted in `local_saves_skipped`);
    a failed local save is logged, and training goes on.

    Args:
      step: the global step (default: `step_counter`'s value).

    Returns:
      The local prefix, or None when skipped.

    Raises:
      ConfigError: the manager has no local tier, or no step is known.
    """
    if self._local is None:
      raise errors.ConfigError(
          "save_local() needs a local tier: pass local_checkpoint_dir= or "
          "local_checkpoint_every_steps= to the CheckpointManager.")
    if step is None:
      if self._step_counter is None:
        raise errors.ConfigError("save_local() needs step= or the manager's step_counter.")
      step = _number(self._step_counter)
    step = _number(step)
    if self._local_writer.running():
      self.local_saves_skipped += 1
      return None
    self._wait_local()
    prefix = self._local.layout.prefix(step)
    if fs.exists(layout_lib.manifest_path(prefix)):
      return prefix
    items = self._local_gather()
    required = False
    if self._per_worker_ckpt is not None:
      items += self._per_worker_items()
      required = any(getattr(obj, "tfdp_required", True) for obj in self._per_worker.values())
    files = [items_lib.snapshot(f) for f in planner.split_for_parallel_write(items)]
    meta = self._meta(step, step, None, tier="local", run_token=self._local.token,
                      per_worker_required=required)
    job = self._local.job(step, self._local_save_id(), files, meta, self._timeout)
    local = self._local

    def write():
      storage.run(job)
      local.prune()

    self._local_writer.submit(write)
    return prefix

  def drop_local(self) -> None:
    """Deletes this worker's local copies (e.g. once training completed and the persistent tier has the end)."""
    if self._local is None:
      return
    self._wait_local()
    for prefix in self._local.layout.committed():
      self._local.delete(prefix)

  def _local_save_id(self):
    # Not the persistent saves' sequence: that one names their shared temp
    # dir, and must stay the same on every worker.
    self._local_seq += 1
    return f"{self._session}-local{self._local_seq:06d}"

  def _wait_local(self):
    try:
      self._local_writer.wait()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: a local checkpoint save failed (training goes on; the "
                      "persistent tier is not affected): %s", e)

  def _meta(self, number, step, metrics, **extra):
    return manifest_lib.SaveMeta(
        checkpoint_number=number, step=step,
        metrics={str(k): float(v) for k, v in (metrics or {}).items()},
        global_batch_size=self._global_batch_size,
        per_worker_keys=sorted(self._per_worker),
        versions={"tfdp": tfdp.__version__, "tensorflow": tf.__version__,
                  "keras": keras.__version__}, **extra)

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
    self._wait_local()
    self.restored_tier = None
    if self._local is not None:
      prefix = self._restore_tiered(before_restore)
      if prefix is not None:
        return prefix
    for prefix, _ in self._intact_candidates():
      try:
        if before_restore is not None:
          before_restore(prefix)
        self.restore(prefix)
        self.restored_tier = "persistent"
        return prefix
      except errors.CorruptCheckpointError as e:
        logging.warning("tfdp: Skipping a corrupt checkpoint: %s", e)
    return None

  def _intact_candidates(self):
    """Yields (prefix, manifest) of the persistent checkpoints, newest first, whose files are all there.

    A checkpoint with a missing or short file is set aside, with a warning.
    """
    with self._lock:
      candidates = self._catalog.candidates()
    for prefix in candidates:
      man = self._manifest(prefix)
      if self._verify:
        try:
          restore_lib.check_sizes(prefix, man)
        except errors.CorruptCheckpointError as e:
          logging.warning("tfdp: Skipping a corrupt checkpoint: %s", self._set_aside(prefix, e))
          continue
      yield prefix, man

  def _newest_persistent_step(self):
    """The step of the newest intact persistent checkpoint, or None."""
    for prefix, man in self._intact_candidates():
      return man.step if man is not None else layout_lib.number_of(prefix)
    return None

  def _restore_tiered(self, before_restore):
    """Restores the newest state the workers can have from the local tiers; None: use the persistent tier.

    The protocol (every worker runs it; see tfdp.checkpoint.tiers):
    1. each worker lists its intact local copies and the newest persistent
       step, and one all-reduce gives every worker every worker's list;
    2. `tiers.choose` picks, the same on every worker: the newest local
       step held by all ("local"), or held by some and recoverable without
       per-worker state ("peer"), else the persistent tier;
    3. the holders restore their own copy; after one all-reduce of their
       outcome, the others get each tensor from the first holder (one
       all-reduce per tensor), write it as a local copy and restore it;
    4. a worker whose copy turned out damaged deletes it, and all go back to 1.
    """
    strategy = self._me.strategy
    # tf.train.Checkpoint makes its save counter on the first restore; under
    # a MultiWorkerMirroredStrategy that is a broadcast, so every worker
    # makes it here, not only those that restore before the others.
    self._checkpoint.save_counter  # pylint: disable=pointless-statement
    persistent_step = self._newest_persistent_step()
    for _ in range(tiers.LOCAL_KEEP + 1):
      held = self._local.held()
      choice = tiers.choose(cluster.gather(tiers.offer(held, persistent_step), strategy))
      if choice.kind == "persistent":
        if self._me.is_chief and held:
          logging.info("tfdp: no local copy is newer than the persistent tier (step %s).",
                       persistent_step)
        return None
      mine = next((h for h in held if h.step == choice.step), None)
      start = time.perf_counter()
      outcome = self._restore_local(mine, before_restore) if mine is not None else _OK
      if choice.kind == "peer":
        if self._agree_outcome(outcome) != _OK:
          continue
        # Every worker takes part in the transfer; the holders' values are
        # the restored ones, the first holder's are sent.
        sent = time.perf_counter()
        items = tiers.transfer(items_lib.gather(self._checkpoint), choice.holders[0],
                               strategy)
        phases = {"transfer": time.perf_counter() - sent}
        if mine is None:
          wrote = time.perf_counter()
          try:
            mine = self._write_recovered(choice, items)
          except Exception as e:  # pylint: disable=broad-except
            outcome = e  # Raised on every worker by the agreement below.
          else:
            phases["write"] = time.perf_counter() - wrote
            outcome = self._restore_local(mine, before_restore, per_worker=False)
            phases["restore"] = time.perf_counter() - wrote - phases["write"]
      if self._agree_outcome(outcome) != _OK:
        continue
      self._restored(mine.prefix, mine.manifest)
      self.restored_tier = choice.kind
      seconds = time.perf_counter() - start
      if choice.kind == "local":
        if self._me.is_chief:
          logging.info("tfdp: restored step %d from the local tier (each worker's own "
                       "copy, %.2f s).", choice.step, seconds)
      elif self._me.index not in choice.holders:
        logging.warning(
            "tfdp: recovered step %d from worker %d through collectives (this worker "
            "had no local copy): %.1f MB in %.2f s (%s).", choice.step, choice.holders[0],
            mine.manifest.state_bytes / 1e6, seconds,
            ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
      elif self._me.is_chief:
        logging.info("tfdp: restored step %d from the local tier; worker(s) %s got it "
                     "from worker %d.", choice.step,
                     sorted(set(range(self._me.count)) - set(choice.holders)),
                     choice.holders[0])
      return mine.prefix
    return None

  def _restore_local(self, held, before_restore, per_worker=True):
    """Restores one local copy; returns _OK, _DAMAGED (the copy is deleted) or the exception."""
    try:
      if before_restore is not None:
        before_restore(held.prefix)
      restore_lib.restore_verified(self._checkpoint, held.prefix, held.manifest)
      if per_worker and self._per_worker_ckpt is not None:
        restore_lib.restore_per_worker(self._per_worker_ckpt, held.prefix, self._me.index,
                                       held.manifest)
      return _OK
    except errors.CorruptCheckpointError as e:
      logging.warning("tfdp: deleting a damaged local checkpoint: %s", e)
      self._local.delete(held.prefix)
      return _DAMAGED
    except Exception as e:  # pylint: disable=broad-except
      return e

  def _agree_outcome(self, outcome):
    """The worst outcome of any worker; a failure other than damage is raised on every worker."""
    code = 0 if outcome is _OK else 1 if outcome is _DAMAGED else 2
    worst = int(cluster.agree(code, "max", self._me.strategy))
    if worst == 2:
      if isinstance(outcome, Exception):
        raise outcome
      raise errors.CheckpointError(
          "Another worker failed to restore its local checkpoint (its log says why).")
    return _OK if worst == 0 else _DAMAGED

  def _write_recovered(self, choice, items):
    """Writes this worker's local copy of `choice.step` from the values received."""
    meta = self._meta(choice.step, choice.step, None, tier="local",
                      run_token=self._local.token, per_worker_required=False)
    job = self._local.job(choice.step, self._local_save_id(),
                          planner.split_for_parallel_write(items), meta, self._timeout)
    man = storage.run(job)
    self._local.prune()
    return tiers.Held(choice.step, job.prefix, man)

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
    self._wait_local()
    self._writer.wait()

  wait_until_finished = sync

  def close(self) -> None:
    """Waits for the background save and releases the directory; a later save takes it again."""
    try:
      self._wait_local()
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

  def _per_worker_items(self):
    """This worker's per-worker state as Items under its own keys (`_tfdp_per_worker/<i>/`)."""
    return items_lib.gather(self._per_worker_ckpt, layout_lib.per_worker_prefix(self._me.index),
                            with_object_graph=False)

  def _plan(self):
    local = None
    if self._per_worker_ckpt is not None:
      local = {self._me.index: self._per_worker_items()}
    items = items_lib.gather(self._checkpoint)
    self._local_gather.check(items)
    plan = planner.plan_save(items, self._me.count,
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
