"""CheckpointManager's face of the local tier: its properties, `local_due`, `save_local` and `drop_local`."""

from tfdp import errors
from tfdp.checkpoint.format import items as items_lib


def _local_property(get, doc, default=None):
  """A read-only property of the manager's local tier: `get(tier)`, or `default` without one."""
  return property(lambda self: get(self._local) if self._local is not None else default,
                  doc=doc)


class LocalFace:
  """The local-tier part of `tfdp.CheckpointManager`'s API (a mixin: the manager owns `_local`).

  The manager sets `_local` (a `tfdp.checkpoint.local.LocalTier` or None),
  `_step_counter`, `_taken` (what its persistent save of a step took),
  `_gather` and `_per_worker`, and gives `_meta(...)` (a SaveMeta).
  """

  _local = None
  _step_counter = None
  _taken = None

  # The local tier (None, 0 and [] without one).
  local_checkpoint_every_steps = _local_property(
      lambda t: t.every_steps,
      "How often the training loop saves to the local tier (an int, 'auto' or None).")
  local_interval = _local_property(lambda t: t.interval,
                                   "The steps between local saves now (with 'auto': agreed).")
  local_tuning = _local_property(
      lambda t: t.cadence.tuning,
      "With 'auto': the measurement behind the interval now "
      "(tfdp.checkpoint.local.cadence.Tuning), or None before the first.")
  local_directory = _local_property(lambda t: t.layout.directory,
                                    "This worker's local-tier directory.")
  local_saves_skipped = _local_property(
      lambda t: t.skipped,
      "Local saves never written: a newer one came while they waited for the previous one.",
      default=0)

  def local_due(self, step: int) -> bool:
    """Whether the training loop saves locally after `step`; every worker asks at every step."""
    due = self._local is not None and self._local.due(step)
    if not due:
      self._taken = None  # No local save of this step: the snapshot goes.
    return due

  def local_checkpoints(self) -> list[str]:
    """Prefixes of this worker's committed local checkpoints, oldest first."""
    return self._local.committed() if self._local is not None else []

  def save_local(self, step: int | None = None) -> str:
    """Saves a whole copy of the state to this worker's local tier, in the background.

    It blocks only to take the state (a host snapshot, as an async save;
    at the step of a persistent save, that save's); the copy is written
    into a slot in the background, its per-worker state sent to the
    neighbour. A save while the previous one is still being written waits
    for it (with one worker, a save waiting already is replaced by the newer
    one, counted in `local_saves_skipped`); a failed local save is logged,
    and training goes on.

    Args:
      step: the global step (default: `step_counter`'s value).

    Returns:
      The local prefix.

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
      step = self._step_counter
    step = items_lib.number(step)
    return self._local.save(step, lambda: self._local_items(step), lambda: self._local_meta(step))

  def drop_local(self) -> None:
    """Deletes this worker's local copies (e.g. once training completed and the persistent tier has the end)."""
    if self._local is not None:
      self._local.drop()

  def _then_local(self, local, step, prefix):
    """A save()'s local save, after its persistent one as in the callbacks: with its save_counter."""
    if local:
      self.save_local(step)
    return prefix

  def _local_items(self, step):
    """What a local copy holds: the state, taken in one traced call, and this worker's per-worker state.

    At the step of a persistent save, what that save took (the same reads
    and data position for both tiers: one snapshot on CPU; on a GPU the
    local tier still copies device tensors into its host mirrors).
    """
    taken, self._taken = self._taken, None
    if taken is not None and taken[0] == step:
      return taken[1]
    return self._gather() + self._per_worker.items()

  def _local_meta(self, step):
    return self._meta(step, step, None, tier="local", run_token=self._local.token,
                      per_worker_required=self._per_worker.required)
