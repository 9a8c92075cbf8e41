"""Where a resumed Keras run continues: what a backup records of its position, read back once into a `Resume`."""

import dataclasses
import time
import weakref

from absl import logging
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.resume import fit_hooks
from tfdp.resume import run_state
from tfdp.resume import train_state as state_lib

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

  Three variables added to the backup's checkpoint (`keras_epoch`,
  `keras_step_in_epoch`, `data_topology`), set as training goes, plus this
  worker's per-worker state (`per_worker()`): its data position (`data`),
  its callbacks' state and its metrics' state (`tfdp.resume.run_state`). `read()`
  turns what a restore put in them into a `Resume`.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, callback):
    self.epoch = tf.Variable(-1, dtype=tf.int64, trainable=False, name=EPOCH_KEY)
    self.step_in_epoch = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                     name=STEP_IN_EPOCH_KEY)
    self.topology = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                name=DATA_TOPOLOGY_KEY)
    setattr(checkpoint, EPOCH_KEY, self.epoch)
    setattr(checkpoint, STEP_IN_EPOCH_KEY, self.step_in_epoch)
    setattr(checkpoint, DATA_TOPOLOGY_KEY, self.topology)
    self.data = DataPosition(callback)
    self.callbacks = run_state.CallbackStates(callback)
    self.metrics = run_state.MetricStates(callback)
    self.epoch_first_step = 0  # The global step the current epoch began at.

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
    """The `Resume` of what a restore just put in the variables."""
    if prefix is None:
      return Resume()
    epoch, in_epoch = int(self.epoch.numpy()), int(self.step_in_epoch.numpy())
    return Resume(prefix=prefix, step=step, epoch=epoch if epoch >= 0 else None,
                  step_in_epoch=in_epoch if in_epoch >= 0 else None, data=self.data.restored,
                  topology=tuple(int(v) for v in self.topology.numpy()), tier=tier)

  def epoch_begin(self, epoch: int) -> None:
    """Epoch `epoch` (0-based: the epochs completed) begins: a backup in it knows its epoch."""
    self.epoch.assign(epoch)

  def batch_end(self, step: int) -> None:
    self.step_in_epoch.assign(step - self.epoch_first_step)

  def epoch_end(self, epoch: int) -> None:
    self.epoch.assign(epoch + 1)
    self.step_in_epoch.assign(0)


# A position is saved as a whole iterator state taken at some step plus the
# steps since (replayed at restore). Taking the whole state costs what
# tf.data's SerializeIterator costs for the pipeline's buffers (about 10 us
# per buffered tensor: 100+ ms for a shuffle(10_000) of small examples), so
# it is taken again only once this share of the time since the last one
# would pay for it, and at most every REPLAY_MAX_STEPS steps.
CAPTURE_BUDGET = 0.01
REPLAY_MAX_STEPS = 2000


@dataclasses.dataclass
class _Base:
  """A whole iterator state taken at `step`, of `iterator` (a weak reference: the base does not keep it alive)."""
  iterator: weakref.ref
  state: tf.Tensor  # The variant: bytes are made by the checkpoint's writer.
  step: int
  seconds: float  # What taking it cost.
  time: float


class DataPosition(trackable_base.Trackable):
  """A backup's per-worker part: where this worker's training data is.

  Saved with every backup (each worker under its own key, in the same commit
  as the variables, taken at the same step) as an iterator state plus the
  steps taken since it; restored into the iterator the resumed `fit` makes
  first, which then replays those steps' elements.
  """

  def __init__(self, callback):
    self._callback = callback
    self.restored = None
    self.kind = "none"
    self._warned = False
    self._base = None

  @property
  def tfdp_required(self) -> bool:
    """Whether the last saved position must be restored exactly (peer recovery needs it not to be)."""
    return self.kind != "none"

  def _serialize_to_tensors(self):
    cb = self._callback
    run = fit_hooks.current(cb.model) if cb.model is not None else None
    state, made, kind, skip = tf.constant(b""), 0, "none", 0
    if run is not None and run.dataset is not None:
      at_epoch_end = int(cb.position.step_in_epoch.numpy()) == 0
      it = run.next_iterator(at_epoch_end=at_epoch_end)
      made, kind = run.dataset.iterators_made, "fresh"
      if it is not None:
        made = it._index - 1  # pylint: disable=protected-access
        try:
          base = self._base_for(it, state_lib.global_step(cb.model))
          state, kind, skip = base.state, "iterator", state_lib.global_step(cb.model) - base.step
        except errors.CheckpointError as e:
          kind = "none"
          if not self._warned:
            self._warned = True
            logging.warning("tfdp: backups will not hold the data position: %s", e)
    self.kind = kind
    return {"state": state, "made": tf.constant(made, tf.int64),
            "kind": tf.constant(kind), "skip": tf.constant(skip, tf.int64)}

  def _base_for(self, it, step: int) -> _Base:
    """The whole state to save this position against: the last one taken, or a new one when due."""
    base, now = self._base, time.perf_counter()
    if (base is None or base.iterator() is not it or step < base.step
        or step - base.step > REPLAY_MAX_STEPS
        or base.seconds < CAPTURE_BUDGET * (now - base.time)):
      start = time.perf_counter()
      variant = it.state_variant()
      base = self._base = _Base(weakref.ref(it), variant, step, time.perf_counter() - start, now)
    return base

  def _restore_from_tensors(self, restored_tensors):
    self.restored = {k: v.numpy() for k, v in restored_tensors.items()}
    return []

  def fit_ended(self) -> None:
    """The fit's iterator is gone: so goes the state taken of it (it holds that iterator's buffered elements)."""
    self._base = None


def resume_data(resume: Resume, model, backup_dir: str,
                restart_epoch_data: bool) -> tuple[int, str | None]:
  """Puts a restored data position into the running `fit`'s input.

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
    reason = _why_no_hooks()
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
      f", {human_bytes(size)} per worker" if size else "") + (
          "; the epoch's steps are done, its end runs again"
          if steps and resume.step_in_epoch >= steps else "")


def human_bytes(n: float) -> str:
  """Bytes in decimal units, as `tfdp-ckpt` prints them: 812 B, 27.3 MB."""
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1000 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000.0
  return f"{n:.1f} TB"


def _why_no_hooks() -> str | None:
  """Why `fit` runs without tfdp's data hooks (tfdp.compat's fit_data_state not installed), or None."""
  from tfdp import compat  # pylint: disable=g-import-not-at-top
  name = "fit_data_state"
  if name in compat.applied():
    return None
  if name in compat.skipped():
    return f"tfdp.compat did not install {name}: {compat.skipped()[name]}"
  if name in compat.disabled_fixes():
    return f"tfdp.compat's {name} is disabled by {compat.DISABLE_ENV}"
  return f"tfdp.compat's {name} is not installed (import tfdp before fit)"
