"""The manager's two tiers: one place hands a step's snapshot (taken once) to the persistent and the local tier when due."""

import dataclasses
import os
import time
from typing import Callable

from absl import logging

from tfdp import errors
from tfdp.checkpoint.schedule import async_writer
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import planner
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.persistent import writer as storage

_number = items_lib.number


class Snapshot:
  """The state at one step, taken at most once and handed to every tier due at that step.

  It is taken by the cached reads (tfdp.checkpoint.format.reads): the
  variables in one traced call, the per-worker state by asking its objects.
  A persistent save first checks, with a walk that reads nothing, that the
  checkpoint's objects are those the reads were made for (they are made
  again if not), and sizes every Item (`for_persistent`); a local save
  alone relies on the last check (`for_local`), as TF's async checkpoint
  does after its first save. At the step of a persistent save the local
  save gets what that one took: the same reads and data position for both
  tiers (one snapshot on CPU; on a GPU the local tier still copies device
  tensors into its host mirrors). It lives for one call of the manager, so
  nothing taken outlives the step.

  Args:
    checkpoint: the `tf.train.Checkpoint`.
    gather: its `tfdp.checkpoint.format.reads.CachedGather`.
    per_worker: the manager's `tfdp.checkpoint.format.items.PerWorker`.
  """

  def __init__(self, checkpoint, gather: reads.CachedGather, per_worker: items_lib.PerWorker):
    self._checkpoint = checkpoint
    self._gather = gather
    self._per_worker = per_worker
    self._taken = None  # Items + this worker's per-worker Items, once taken.

  def for_persistent(self) -> tuple[list[planner.Item], list[planner.Item]]:
    """(the checkpoint's Items, this worker's per-worker Items), sized, after checking the objects."""
    self._gather.check()
    self._per_worker.check()
    items = items_lib.sized(self._gather())
    own = items_lib.sized(self._per_worker.items(cached=True))
    self._taken = items + own
    return items, own

  def for_local(self) -> list[planner.Item]:
    """What a local copy holds: the state and this worker's per-worker state (what a persistent save took, if one did)."""
    if self._taken is None:
      self._taken = self._gather() + self._per_worker.items(cached=True)
    return self._taken


@dataclasses.dataclass(frozen=True)
class Planned:
  """A persistent save numbered and planned: its prefix, the step its manifest holds, and the writer's job."""
  prefix: str
  step: int
  run: Callable[[], None]


class PersistentSaves:
  """The persistent tier as the manager saves to it: a save's number, its plan, and the writer's job, run now or in the background.

  A failed save gives back its increment of the checkpoint's `save_counter`
  (`wait`). The manager decides whether a save is due; this writes it.

  Args:
    checkpoint: the `tf.train.Checkpoint`.
    layout, catalog: the persistent directory's layout and catalog.
    me: this worker.
    per_worker: the manager's `PerWorker`.
    lease: the directory's lease holder (the chief's fence).
    session: this manager's session id.
    keep, hours: the retention policies (tfdp.checkpoint.persistent.retention).
    async_save, max_shard_bytes, global_batch_size, timeout: the manager's.
  """

  def __init__(self, checkpoint, layout, catalog, me, per_worker, lease, session, *, keep, hours,
               async_save, max_shard_bytes, global_batch_size, timeout):
    self._checkpoint = checkpoint
    self._layout = layout
    self._catalog = catalog
    self._me = me
    self._per_worker = per_worker
    self._lease = lease
    self._session = session
    self._keep, self._hours = keep, hours
    self._async = async_save
    self._max_shard_bytes = max_shard_bytes
    self._global_batch_size = global_batch_size
    self._timeout = timeout
    self.writer = async_writer.AsyncWriter()
    self._seq = 0
    self._uncommitted_count = None  # save_counter before a save not yet committed.

  def saved_already(self, checkpoint_number, step) -> str | None:
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

  def prepare(self, snapshot: Snapshot, step, checkpoint_number, metrics, options) -> "Planned":
    """Numbers and plans the save of `snapshot` as the next checkpoint; `write` then writes it."""
    number, prefix = self._next_number(checkpoint_number)
    meta = self.meta(number, number if step is None else step, metrics)
    sweep = self._catalog.plan(prefix, number, meta.metrics, self._keep, self._hours)
    files = self._plan(snapshot)
    if self._me.is_chief:
      self._lease.ensure()  # Released by the manager's close().
    self._seq += 1
    save_id = f"{self._session}-{self._seq:06d}"
    job = storage.SaveJob(
        layout=self._layout, prefix=prefix, tmp_dir=self._layout.tmp_dir(save_id, number),
        save_id=save_id, session=self._session, worker=self._me.index,
        num_workers=self._me.count, files=files,
        timeout=self._timeout, meta=meta,
        kept=tuple(os.path.basename(e.prefix) for e in sweep.kept),
        fence=self._lease.check if self._me.is_chief else None)
    callbacks = list(getattr(options, "experimental_write_callbacks", None) or [])
    return Planned(prefix, meta.step, lambda: self._run(job, sweep, callbacks))

  def write(self, planned: "Planned") -> None:
    """Writes a planned save: in the background when async, else now (its failure raised here)."""
    if self._async:
      self.writer.submit(planned.run)
    else:
      self.wait(planned.run)

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

  def _plan(self, snapshot):
    """This worker's files of the save: a host snapshot of its part when async."""
    items, own = snapshot.for_persistent()
    plan = planner.plan_save(items, self._me.count, max_shard_bytes=self._max_shard_bytes,
                             local_items={self._me.index: own})
    files = plan.for_worker(self._me.index)
    return [items_lib.snapshot(f) for f in files] if self._async else files

  def wait(self, run=None) -> None:
    """Waits for the background save (or runs `run` now); a failure gives back its save_counter increment."""
    try:
      self.writer.wait()
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

  def meta(self, number, step, metrics, **extra) -> manifest_lib.SaveMeta:
    """A save's SaveMeta (either tier's: a local save's names its tier in `extra`)."""
    return manifest_lib.SaveMeta.new(number, step, metrics, self._global_batch_size,
                                     self._per_worker.keys, **extra)


class Tiers:
  """What a `tfdp.CheckpointManager` saves to: a persistent tier and, when asked for, a local one.

  `save` is the one place a save goes to the tiers: it takes the step's
  `Snapshot` once and hands it to the persistent tier when asked, then to the
  local one (as Orbax's emergency CheckpointManager holds a persistent and a
  local manager). The manager's local-tier API (`local_due`, `save_local`,
  ...) is this object's.

  Args:
    checkpoint: the `tf.train.Checkpoint`.
    per_worker: the manager's `PerWorker`.
    persistent: the persistent tier's `PersistentSaves`.
    local: the local tier (tfdp.checkpoint.local.tier.LocalTier), or None.
    step_counter: the manager's step counter (None: none).
    checkpoint_interval: the manager's (None: every `save()` saves).
    last_checkpoint_step: the step of the last save, for the interval.
    keep_own: `fn()` run before each persistent save (the session's `keep_own`).
  """

  def __init__(self, checkpoint, per_worker: items_lib.PerWorker, persistent: PersistentSaves,
               local, step_counter, checkpoint_interval, last_checkpoint_step, keep_own):
    self._checkpoint = checkpoint
    self._per_worker = per_worker
    self.gather = reads.CachedGather(checkpoint)  # The saves' traced reads.
    self.persistent = persistent
    self.local = local
    self._step_counter = step_counter
    self._interval = (policy.MinInterval(checkpoint_interval)
                      if checkpoint_interval is not None else None)
    self._keep_own = keep_own
    # The step of the newest checkpoint saved or restored, and of the newest
    # one counted for `checkpoint_interval`.
    self.last_saved_step = None
    self.last_checkpoint_step = last_checkpoint_step

  def decide(self, check_interval: bool) -> tuple[int | None, bool, bool]:
    """A `save()`'s decision: (the step counter's value or None, save persistently, save locally).

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
        step=step, last_saved_step=self.last_checkpoint_step))
    return step, persistent, local

  def save_at_step(self, step: int, *, persistent: bool, local: bool = True,
                   metrics: dict | None = None, blocked=None) -> str | None:
    """The training loop's saves after `step` (every worker, at every step): one snapshot for the tiers due.

    The persistent tier saves checkpoint `step` when `persistent` (as
    `save(checkpoint_number=step, metrics=metrics)`; the caller's cadence
    decides, not `checkpoint_interval`), then the local tier when its cadence
    says so (as `save_local(step)`), from what the persistent save took.

    Args:
      step: the global step.
      persistent: whether the caller's cadence asks for a persistent save now.
      local: ask the local tier's cadence (False: an epoch's end, the end of
        training, a preemption: the persistent tier only).
      metrics: the persistent save's (see `save`).
      blocked: optional `fn(seconds, tier)` told how long each tier blocked
        the caller ("persistent" or "local").

    Returns:
      The persistent prefix, or None without a persistent save.
    """
    local_step = step if local and self.local_due(step) else None
    if not persistent and local_step is None:
      return None  # Most steps: nothing is read.
    counter = None if self._step_counter is None else _number(self._step_counter)
    return self.save((counter, step, metrics, None) if persistent else None, local_step,
                     blocked)

  def restored(self, prefix: str, man, tier: str) -> None:
    """After a restore of `prefix` (manifest `man`) from `tier`: the steps saved, and the local tier told."""
    step = man.step if man is not None else layout_lib.number_of(prefix)
    self.last_saved_step = step
    if self._interval is not None:
      self.last_checkpoint_step = self.last_saved_step = _number(self._step_counter)
    if self.local is not None:  # What an abandoned attempt saved past it goes, on every worker.
      self.local.restored(step, tier)

  def save(self, persistent, local_step, blocked=None) -> str | None:
    """Takes the step's snapshot and hands it to the persistent tier when asked, then to the local one.

    Args:
      persistent: (step or None, checkpoint_number, metrics, options) of a
        persistent save (see `CheckpointManager.save`), or None.
      local_step: the step of a local save after it (with its save_counter),
        or None.
      blocked: optional `fn(seconds, tier)` told how long each tier blocked.

    Returns:
      The persistent prefix (the newest's when it holds this step already),
      or None without a persistent save.
    """
    snapshot = Snapshot(self._checkpoint, self.gather, self._per_worker)
    prefix = None
    if persistent is not None:
      start = time.perf_counter()
      prefix = self._save_persistent(snapshot, *persistent)
      if blocked is not None:
        blocked(time.perf_counter() - start, "persistent")
    if local_step is not None:
      start = time.perf_counter()
      self.local.save(local_step, snapshot.for_local, lambda: self._local_meta(local_step))
      if blocked is not None:
        blocked(time.perf_counter() - start, "local")
    return prefix

  def _save_persistent(self, snapshot, step, checkpoint_number, metrics, options):
    """A persistent save of `snapshot`, after the previous one (whose failure is raised here)."""
    self.persistent.wait()
    self._keep_own()
    saved = self.persistent.saved_already(checkpoint_number, step)
    if saved is not None:
      logging.debug("tfdp: %s already holds step %s; not saved again.", saved, step)
      return saved
    planned = self.persistent.prepare(snapshot, step, checkpoint_number, metrics, options)
    self.last_saved_step = planned.step
    if step is not None:
      self.last_checkpoint_step = step
    self.persistent.write(planned)
    return planned.prefix

  def _local_meta(self, step):
    return self.persistent.meta(step, step, None, tier="local", run_token=self.local.token,
                                per_worker_required=self._per_worker.required)

  # -- the manager's local-tier API --

  def local_due(self, step: int) -> bool:
    """Whether the training loop saves locally after `step`; every worker asks at every step."""
    return self.local is not None and self.local.due(step)

  def local_checkpoints(self) -> list[str]:
    """Prefixes of this worker's committed local checkpoints, oldest first."""
    return self.local.committed() if self.local is not None else []

  def save_local(self, step: int | None = None) -> str:
    """Saves a whole copy of the state to this worker's local tier, in the background.

    It blocks only to take the state (a host snapshot, as an async save);
    the copy is written into a slot in the background, its per-worker state
    sent to the neighbour. A save while the previous one is still being
    written waits for it (with one worker, a save waiting already is
    replaced by the newer one, counted in `local_saves_skipped`); a failed
    local save is logged, and training goes on. `save_at_step` saves both
    tiers from one snapshot.

    Args:
      step: the global step (default: `step_counter`'s value).

    Returns:
      The local prefix.

    Raises:
      ConfigError: the manager has no local tier, or no step is known.
    """
    if self.local is None:
      raise errors.ConfigError(
          "save_local() needs a local tier: pass local_checkpoint_dir= or "
          "local_checkpoint_every_steps= to the CheckpointManager.")
    if step is None:
      if self._step_counter is None:
        raise errors.ConfigError("save_local() needs step= or the manager's step_counter.")
      step = self._step_counter
    step = items_lib.number(step)
    self.save(None, step)
    return self.local.layout.prefix(step)

  def drop_local(self) -> None:
    """Deletes this worker's local copies (e.g. once training completed and the persistent tier has the end)."""
    if self.local is not None:
      self.local.drop()
