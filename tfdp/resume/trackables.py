"""The trackables a backup saves of a Keras run besides its variables and data: its callbacks' state and its metrics' state, per worker.

Two per-worker parts of every backup of `tfdp.callbacks.BackupAndRestore`
(saved by each worker under its own key, in the same commit as the
variables):
- `callbacks`: the state of every stateful callback of the running `fit`
  (`tfdp.resume.callback_state`): EarlyStopping's counters, the rows CSVLogger wrote;
- `metrics`: each local replica's part of every compiled metric (a `Mean`'s
  total and count, ...), so an epoch resumed in its middle logs the metrics
  of the whole epoch, as the run that never stopped does.
"""

from __future__ import annotations

import json

from absl import logging
import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tfdp.resume import callback_state
from tfdp.resume import fit_hooks
from tfdp.checkpoint.format import layout as layout_lib

CALLBACKS_KEY = "callbacks"
METRICS_KEY = "metrics"


def run_callbacks(backup) -> list:
  """The callbacks of the `fit` `backup` runs in, other than tfdp's own backups ([] outside fit)."""
  run = fit_hooks.current(backup.model) if backup.model is not None else None
  if run is None:
    return []
  return [c for c in run.callbacks if not getattr(c, "tfdp_runs_last", False)]


class CallbackStates(trackable_base.Trackable):
  """The per-worker part of a backup that holds the running fit's callbacks' state (`tfdp.resume.callback_state`)."""

  def __init__(self, backup):
    self._backup = backup
    self._held = False
    self.restored = None  # (JSON, arrays) of the last restore, until applied.
    self._last = None  # ((JSON, arrays), their tensors) of the last save.

  @property
  def tfdp_required(self) -> bool:
    """Whether the last backup held any callback's state (a peer recovery must bring it)."""
    return self._held

  def _serialize_to_tensors(self):
    text, blob = callback_state.capture(run_callbacks(self._backup))
    self._held = b'"callbacks": {}' not in text
    if self._last is None or self._last[0] != (text, blob):
      # Callbacks' state changes at epochs' ends: the tensors of an unchanged one are made
      # once, eagerly (also when asked inside a trace), so any later save may reuse them.
      with tf.init_scope():
        self._last = ((text, blob), {"state": tf.constant(text), "arrays": tf.constant(blob)})
    return dict(self._last[1])

  def _restore_from_tensors(self, restored_tensors):
    self.restored = (restored_tensors["state"].numpy(), restored_tensors["arrays"].numpy())
    return []

  def apply(self, callbacks) -> list[str]:
    """Puts the restored state (if any) into `callbacks`; returns the keys restored."""
    restored, self.restored = self.restored, None
    if restored is None:
      return []
    done = callback_state.restore(callbacks, *restored)
    if done:
      logging.info("tfdp: restored the state of %s.", ", ".join(done))
    return done


def chief_callbacks(prefix: str):
  """The chief's callback state in the backup at `prefix` as (JSON, arrays), or None (for a worker it has none of)."""
  reader = tf.train.load_checkpoint(prefix)
  root = f"{layout_lib.per_worker_prefix(0)}{CALLBACKS_KEY}/.ATTRIBUTES/"
  if not (reader.has_tensor(root + "state") and reader.has_tensor(root + "arrays")):
    return None
  return reader.get_tensor(root + "state"), reader.get_tensor(root + "arrays")


def _tf_variable(v):
  return v if isinstance(v, tf.Variable) else v.value


class MetricStates(trackable_base.Trackable):
  """The per-worker part of a backup that holds each local replica's part of the model's metrics.

  Keras's metric variables are synchronized on read: each replica adds to
  its own copy, and `fit` sums them over all replicas of all workers when it
  logs an epoch. Saving each local copy as it is (no reduction, no
  collective) and putting each back into its own copy makes the resumed
  epoch's sums, and so its logs, bitwise those of an uninterrupted epoch.
  Held as one JSON text (a few numbers per metric; exact for every dtype):
  without a strategy Keras makes some metrics' variables only when it
  traces the first step, after the restore.
  """

  def __init__(self, backup):
    self._backup = backup
    self.restored = None  # {key: [dtype, shape, values]} of the last restore, until applied.
    self._read = None  # (the parts, one traced function reading them all)

  def _parts(self) -> dict:
    """{key: one local replica's copy of one metric variable} of the model now."""
    model = self._backup.model
    if model is None or not getattr(model, "compiled", False):
      return {}
    strategy = model.distribute_strategy
    out = {}
    for i, v in enumerate(model.metrics_variables):
      for r, part in enumerate(strategy.experimental_local_results(_tf_variable(v))):
        out[f"{i}.{r}.{v.path}"] = part
    return out

  # Not needed to restore a copy exactly (peer recovery may go without it):
  # every worker then logs the same sums, of the steps whose state is there.
  # Where the position follows from the step (tfdp.fit), a worker lost
  # before its first local save would otherwise leave no step to recover.
  tfdp_required = False

  def _values(self, parts: dict) -> list:
    """The parts' values, read in one call of a traced function (an eager read each costs ~50 us)."""
    ids = tuple(map(id, parts.values()))
    if self._read is None or self._read[0] != ids:
      listed = list(parts.values())
      read = tf.function(lambda: [p.read_value() for p in listed], autograph=False)
      # The concrete function: called as is, without the dispatch on arguments (~0.3 ms).
      self._read = (ids, read.get_concrete_function() if listed else None,
                    listed)  # Holds the parts: their ids stay theirs.
    return [t.numpy() for t in self._read[1]()] if parts else []

  def _serialize_to_tensors(self):
    parts = self._parts()
    state = {key: [value.dtype.name, list(value.shape), value.ravel().tolist()]
             for key, value in zip(parts, self._values(parts))}
    return {"state": tf.constant(json.dumps(state))}

  def _restore_from_tensors(self, restored_tensors):
    self.restored = json.loads(restored_tensors["state"].numpy().decode())
    return []

  def apply(self) -> bool:
    """Puts the restored metric state (if any) back into the model's metrics; whether it did."""
    restored, self.restored = self.restored, None
    run = fit_hooks.current(self._backup.model)
    if run is not None:
      run.build_metrics()
    parts = self._parts()
    if not parts:
      return False
    if restored is None:
      logging.warning("tfdp: the backup holds no metric state for this worker (an older "
                      "backup, or a copy recovered from a peer without it); the resumed "
                      "epoch's metrics leave out its steps before the resume.")
      return False
    wrong = sorted(k for k in parts if k not in restored or list(parts[k].shape) != restored[k][1])
    if wrong or set(restored) != set(parts):
      logging.warning("tfdp: the backup's metric state does not fit this model's metrics "
                      "(%s); the resumed epoch's metrics cover its remaining steps only.",
                      wrong[0] if wrong else "another number of metrics or replicas")
      return False
    for key, part in parts.items():
      dtype, shape, values = restored[key]
      part.assign(np.array(values, dtype=tf.as_dtype(dtype).as_numpy_dtype).reshape(shape))
    return True
