"""The data position a backup holds: where this worker's training data is, as an iterator state plus the steps since.

It stays in tfdp.resume, not tfdp.data: it finds the running `fit`'s
iterator through tfdp.resume.fit_hooks and the global step through
tfdp.resume.train_state, and tfdp.data may import neither.
"""

import dataclasses
import functools
import time
import weakref

from absl import logging
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tfdp import errors
from tfdp.resume import fit_hooks
from tfdp.resume import train_state as state_lib

# A position is saved as a whole iterator state taken at some step plus the
# steps since (replayed at restore). Taking the whole state costs what
# tf.data's SerializeIterator costs for the pipeline's buffers (about 10 us
# per buffered tensor: 100+ ms for a shuffle(10_000) of small examples), so
# it is taken again only once this share of the time since the last one
# would pay for it, and at most every REPLAY_MAX_STEPS steps.
CAPTURE_BUDGET = 0.01
REPLAY_MAX_STEPS = 2000


@functools.lru_cache(maxsize=64)
def _constant(value, dtype=None) -> tf.Tensor:
  """A constant tensor, made once: what a save holds that rarely changes (at every save)."""
  with tf.init_scope():
    return tf.constant(value, dtype)


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
    state, made, kind, skip = _constant(b""), 0, "none", 0
    if run is not None and run.dataset is not None:
      at_epoch_end = cb.position.in_epoch == 0
      it = run.next_iterator(at_epoch_end=at_epoch_end)
      made, kind = run.dataset.iterators_made, "fresh"
      if it is not None:
        made = it._index - 1  # pylint: disable=protected-access
        try:
          step = cb.position.saving_step
          step = state_lib.global_step(cb.model) if step is None else step
          base = self._base_for(it, step)
          state, kind, skip = base.state, "iterator", step - base.step
        except errors.CheckpointError as e:
          kind = "none"
          if not self._warned:
            self._warned = True
            logging.warning("tfdp: backups will not hold the data position: %s", e)
    self.kind = kind
    return {"state": state, "made": _constant(made, tf.int64), "kind": _constant(kind),
            "skip": tf.constant(skip, tf.int64)}

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
