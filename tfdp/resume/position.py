"""Where a resumed Keras run continues: what a backup records of its position, read back once into a `Resume`.

The data position itself is tfdp.resume.data_position's; the save cadence
is tfdp.checkpoint.schedule.policy's.
"""

import contextlib
import dataclasses

from absl import logging
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.resume import callback_state
from tfdp.resume import data_position
from tfdp.resume import fit_hooks
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.format import units
from tfdp.resume import trackables as run_state

# Name of the completed-epoch counter a backup holds (Keras's callback keeps
# the same number in its training metadata).
EPOCH_KEY = "keras_epoch"
# Steps of the current epoch done (-1: unknown, a backup without it), and the
# [workers, replicas] whose data positions a backup holds ([0, 0]: none).
STEP_IN_EPOCH_KEY = "keras_step_in_epoch"
DATA_TOPOLOGY_KEY = "data_topology"
# The per-worker state key of the data position.
DATA_KEY = "data"


@dataclasses.dataclass(frozen=True)
class Resume:
  """Where a run continues, computed once from the checkpoint a backup restored.

  Attributes:
    prefix: the restored checkpoint (None: nothing was restored).
    step: the global step (the optimizer's iterations) it holds.
    epoch: epochs completed (None: the backup does not say).
    step_in_epoch: steps done of the next epoch (None: unknown).
    data: this worker's data position ({"state", "made", "kind"}), or None.
    topology: (workers, replicas) whose data positions the backup holds;
      (0, 0) when it holds none.
    tier: the tier it came from ("persistent", "local", "peer").
  """
  prefix: str | None = None
  step: int = 0
  epoch: int | None = None
  step_in_epoch: int | None = None
  data: dict | None = None
  topology: tuple[int, int] = (0, 0)
  tier: str | None = None

  @property
  def mid_epoch(self) -> bool:
    """Whether it restored steps of an epoch that had not ended (so not the epoch's end)."""
    return self.restored and bool(self.step_in_epoch)

  @property
  def restored(self) -> bool:
    return self.prefix is not None

  def completed_epochs(self, steps_per_epoch: int | None = None) -> int | None:
    """Epochs completed (None when nothing was restored); from the step when the backup has no count."""
    if not self.restored:
      return None
    if self.epoch is None and steps_per_epoch:
      return self.step // steps_per_epoch
    return max(self.epoch or 0, 0)

  def describe(self, data: str | None = None) -> str:
    """One line: what was restored and where training goes on, e.g.

    `resumed from runs/x/ckpt-256 at step 256 (epoch 3, step 16 of it; data
    position restored)`; `data` says what became of the input's position.
    """
    notes = []
    if self.epoch is not None:
      notes.append(f"epoch {self.epoch + 1}" + (
          f", step {self.step_in_epoch} of it" if self.step_in_epoch else ""))
    if data:
      notes.append(data)
    tier = f" (the {self.tier} tier)" if self.tier and self.tier != "persistent" else ""
    return (f"resumed from {self.prefix}{tier} at step {self.step}"
            + (f" ({'; '.join(notes)})" if notes else ""))


def topology(strategy) -> tuple[int, int]:
  """(workers, replicas in sync) of `strategy`."""
  return (cluster.resolve(strategy).count, strategy.num_replicas_in_sync)


class Position:
  """What a backup records of where a Keras run is: epochs done, the step within the epoch, the data topology.

  Three values added to the backup's checkpoint (`keras_epoch`,
  `keras_step_in_epoch`, `data_topology`: `reads.PythonValue`s, saved as
  variables of those names are), set as training goes, plus this
  worker's per-worker state (`per_worker()`): its data position (`data`),
  its callbacks' state and its metrics' state (`tfdp.resume.trackables`). `read()`
  turns what a restore put in them into a `Resume`.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, callback):
    # Saved as variables of these names are, but set without a TF op (a
    # mirrored assign at every save cost the step about 0.4 ms).
    self.epoch = reads.PythonValue(-1, tf.int64)
    self.step_in_epoch = reads.PythonValue(-1, tf.int64)
    self.topology = reads.PythonValue([0, 0], tf.int64)
    setattr(checkpoint, EPOCH_KEY, self.epoch)
    setattr(checkpoint, STEP_IN_EPOCH_KEY, self.step_in_epoch)
    setattr(checkpoint, DATA_TOPOLOGY_KEY, self.topology)
    self.data = data_position.DataPosition(callback)
    self.callbacks = run_state.CallbackStates(callback)
    self.metrics = run_state.MetricStates(callback)
    self.epoch_first_step = 0  # The global step the current epoch began at.
    self.saving_step = None  # The global step of the save being taken (None: none is).
    self.metrics_pending = False  # The restored epoch's metrics so far wait for its begin.

  @property
  def in_epoch(self) -> int | None:
    """The steps done of this epoch, as the last step's end or a restore left them (None: unknown)."""
    steps = int(self.step_in_epoch.value)
    return steps if steps >= 0 else None

  def per_worker(self) -> dict:
    """The backup's per-worker state: name -> trackable (a `tfdp.CheckpointManager`'s `per_worker`)."""
    return {DATA_KEY: self.data, run_state.CALLBACKS_KEY: self.callbacks,
            run_state.METRICS_KEY: self.metrics}

  def reset(self) -> None:
    """Before a restore: a backup without these keys leaves them unknown."""
    self.epoch.assign(-1)
    self.step_in_epoch.assign(-1)
    self.topology.assign([0, 0])
    self.data.restored = None
    self.callbacks.restored = None
    self.metrics.restored = None

  def read(self, prefix: str | None, step: int, tier: str | None) -> Resume:
    """The `Resume` of what a restore just put in the three values."""
    if prefix is None:
      return Resume()
    epoch = int(self.epoch.value)
    return Resume(prefix=prefix, step=step, epoch=epoch if epoch >= 0 else None,
                  step_in_epoch=self.in_epoch, data=self.data.restored,
                  topology=tuple(int(v) for v in self.topology.numpy()), tier=tier)

  def take_chief_callbacks(self, prefix: str | None) -> None:
    """After a restore: a worker the backup has no callback state of (another topology) takes the chief's."""
    if prefix is not None and self.callbacks.restored is None:
      self.callbacks.restored = run_state.chief_callbacks(prefix)

  def continue_callbacks(self, callback) -> None:
    """At train begin, after every other callback's (which resets most): their restored state."""
    callbacks = run_state.run_callbacks(callback)
    callback_state.train_begin(callbacks)
    self.callbacks.apply(callbacks)

  def continue_metrics(self) -> None:
    """At the first epoch begin after a restore from inside an epoch: that epoch's metrics so far."""
    if self.metrics_pending:
      self.metrics.apply()
    self.metrics_pending = False  # Later epochs start from zero, as in the uninterrupted run.
    self.metrics.restored = None

  def ends_epoch(self, step: int, steps: int | None) -> bool:
    """Whether `step` is the current epoch's last, the epoch having `steps` (None: unknown)."""
    return bool(steps) and step - self.epoch_first_step >= steps

  def epoch_begin(self, epoch: int) -> None:
    """Epoch `epoch` (0-based: the epochs completed) begins: a backup in it knows its epoch."""
    self.epoch.assign(epoch)

  def batch_end(self, step: int) -> None:
    """A step ended: its place in the epoch (no TF op)."""
    self.step_in_epoch.assign(step - self.epoch_first_step)

  @contextlib.contextmanager
  def saving(self, step: int):
    """While the callback may save global step `step` (the data position's step)."""
    self.saving_step = step
    try:
      yield
    finally:
      self.saving_step = None

  def epoch_end(self, epoch: int) -> None:
    self.epoch.assign(epoch + 1)
    self.step_in_epoch.assign(0)


def resume_data(resume: Resume, model, backup_dir: str, restart_epoch_data: bool,
                why_no_hooks) -> tuple[int, str | None]:
  """Puts a restored data position into the running `fit`'s input.

  Args:
    resume: what the restore restored.
    model: the model whose `fit` runs.
    backup_dir: the backups' directory (named in a refusal).
    restart_epoch_data: restart the interrupted epoch's data rather than
      refuse a backup of another topology.
    why_no_hooks: `fn()` -> why `fit` runs without tfdp's data hooks, or
      None (tfdp.compat installs them, and resume may not import it: the
      caller asks).

  Returns:
    (the steps of the epoch it skips, what became of the data position: a
    few words for the resume line, None when nothing was restored).

  Raises:
    ConfigError: the backup holds the data positions of another topology and
      `restart_epoch_data` is off.
  """
  run = fit_hooks.current(model)
  restarts = "the interrupted epoch's data restarts"
  if not resume.restored:
    return 0, None
  if run is None:
    reason = why_no_hooks()
    if resume.topology[0] and reason:
      logging.warning("tfdp: the backup holds the data position, but %s; the interrupted "
                      "epoch restarts from its first batch.", reason)
    return 0, restarts
  saved, now = list(resume.topology), list(topology(model.distribute_strategy))
  if saved[0] and saved != now:
    message = (f"the backup in {backup_dir} holds the data positions of "
               f"{saved[0]} worker(s) with {saved[1]} replica(s) in all, this job "
               f"has {now[0]} with {now[1]}; a data position cannot be split over "
               "another topology")
    if not restart_epoch_data:
      raise errors.ConfigError(
          f"{message}. Resume with the same number of workers and replicas, use "
          "a tfdp.data source with tfdp.fit (topology-independent), or pass "
          "BackupAndRestore(..., restart_epoch_data=True) to restart the "
          "interrupted epoch's data.")
    logging.warning("tfdp: %s; restarting the interrupted epoch's data.", message)
    return 0, restarts
  position = resume.data
  if run.dataset is None or not saved[0] or position is None or (
      position["kind"] == b"none") or resume.step_in_epoch is None:
    reason = (run.not_saved_reason if run.dataset is None else
              "the backup holds no data position (an older backup, or an input "
              "tf.data could not save)")
    logging.warning("tfdp: %s; the interrupted epoch restarts from its first batch.", reason)
    return 0, restarts
  run.dataset.set_pending(position["state"] if position["kind"] == b"iterator" else None,
                          int(position["made"]), int(position.get("skip", 0)))
  run.skip_steps(resume.step_in_epoch)
  logging.info("Resuming the data at step %d of epoch %d.", resume.step_in_epoch,
               (resume.epoch or 0) + 1)
  size = len(position["state"]) if position["kind"] == b"iterator" else 0
  steps = run.epoch_iterator.num_batches if run.epoch_iterator is not None else None
  return resume.step_in_epoch, "data position restored" + (
      f", {units.human_bytes(size)} per worker" if size else "") + (
          "; the epoch's steps are done, its end runs again"
          if steps and resume.step_in_epoch >= steps else "")

