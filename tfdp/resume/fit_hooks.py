"""What a running `model.fit` holds that tfdp's callbacks need: its epoch iterator and its data.

Keras makes the training data's iterator inside `fit`, before any callback
runs, and gives callbacks no handle on it. `tfdp.compat` installs the hooks
below (fix `fit_data_state`; probed, revertible) so that while `fit` runs:

- `current(model)` returns the `FitRun`: Keras's training `TFEpochIterator`
  and, when a callback asked for the data position (`wants_data_state`), the
  `tfdp.data.iterators.CheckpointableDataset` that replaced Keras's distributed
  dataset (same elements, checkpointable iterators);
- `FitRun.skip_steps(n)` makes the next epoch start at step n without taking
  any data (the restored iterator is already there); an epoch resumed after
  its last step runs no step and logs the restored metrics of the whole
  epoch (`wrap_metrics_or_logs`);
- tfdp's own callbacks (its BackupAndRestore sets `tfdp_runs_last`) come
  after the others in every hook, in their order, so that a backup holds
  the others' state after the step and a restore comes after their
  `on_train_begin`.

With fix `chief_only_verbose`, workers other than the chief print nothing
from `fit`, `evaluate`, `predict` (`wrap_quiet`), nor from Keras's own
callbacks, whatever `verbose` says, unless $TFDP_PROGRESS_ALL_WORKERS=1. The
Keras names all this relies on are checked by the fixes' probes
(tfdp/compat/fit_fixes.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import threading
import time

from absl import logging
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.data import iterators

_runs = threading.local()

# Keras's adapters whose tf.data pipeline tf.data can serialize (class names
# in keras.src.trainers.data_adapters). Others (generators, PyDataset, grain,
# torch) run Python code tf.data cannot save.
SERIALIZABLE_ADAPTERS = ("TFDatasetAdapter", "ArrayDataAdapter")
# Set to 1, every worker prints what `verbose` says (default: only the chief).
ALL_WORKERS_ENV = "TFDP_PROGRESS_ALL_WORKERS"


@dataclasses.dataclass
class FitRun:
  """One `model.fit` call in progress."""
  model: object
  wants_data_state: bool
  epochs: int = 1
  epoch_iterator: object = None
  dataset: iterators.CheckpointableDataset | iterators.LocalDataset | None = None
  not_saved_reason: str | None = None
  callbacks: list = dataclasses.field(default_factory=list)
  started: float = dataclasses.field(default_factory=time.time)  # wall time of the call

  def skip_steps(self, steps: int) -> None:
    """The next epoch starts at step `steps` (its earlier steps are done; no data is taken)."""
    if self.epoch_iterator is not None:
      self.epoch_iterator._tfdp_skip_steps = int(steps)  # pylint: disable=protected-access

  def build_metrics(self) -> None:
    """Builds the model's compiled metrics now, from the training data's element spec, if Keras has not yet.

    Without a strategy Keras builds them when it traces the first step: a
    metric state restored before that would have no variables to go to.
    """
    model, ei = self.model, self.epoch_iterator
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is None or metrics.built or ei is None:
      return
    spec = getattr(getattr(ei, "_distributed_dataset", None), "element_spec", None)
    if spec is not None:
      model._symbolic_build(data_batch=tf.nest.map_structure(  # pylint: disable=protected-access
          lambda s: s._value_specs[0] if hasattr(s, "_value_specs") else s, spec))  # pylint: disable=protected-access

  def next_iterator(self, at_epoch_end: bool):
    """The iterator the next training step takes its batch from; None: one Keras will make.

    Mid-epoch it is the newest iterator. At the end of an epoch Keras keeps
    its iterator for the next epoch only with `steps_per_epoch` and data left
    (keras/src/trainers/epoch_iterator.py `_enumerate_iterator`).
    """
    if self.dataset is None:
      return None
    if not at_epoch_end:
      return self.dataset.current
    ei = self.epoch_iterator
    if ei.steps_per_epoch is None or ei._current_iterator is None:  # pylint: disable=protected-access
      return None
    return ei._current_iterator  # pylint: disable=protected-access


def _stack():
  if not hasattr(_runs, "stack"):
    _runs.stack = []
  return _runs.stack


def current(model) -> FitRun | None:
  """The innermost `fit` of `model` running in this thread, or None."""
  for run in reversed(_stack()):
    if run.model is model:
      return run
  return None


def _is_chief(model) -> bool:
  try:
    return cluster.resolve(model.distribute_strategy).is_chief
  except Exception:  # pylint: disable=broad-except
    return True  # Output is never a reason to fail.


def _listed(callbacks) -> list:
  """The callbacks of a fit's `callbacks` argument (a list, a tuple, a CallbackList or None)."""
  if not callbacks:
    return []
  return list(callbacks) if isinstance(callbacks, (list, tuple)) else list(callbacks.callbacks)


def _last(callback) -> bool:
  return (getattr(callback, "tfdp_runs_last", False)
          or type(callback).__module__.split(".")[0] == "tfdp")


def runs_last(callbacks):
  """`callbacks` with tfdp's own (those that set `tfdp_runs_last`, or of tfdp's modules) moved to the end.

  Their order among themselves is kept (tfdp-train brackets its backup with
  timing markers). A CallbackList is left as given.
  """
  if not isinstance(callbacks, (list, tuple)):
    return callbacks
  return [c for c in callbacks if not _last(c)] + [c for c in callbacks if _last(c)]


def wrap_fit(original):
  """`Trainer.fit` that records the FitRun, with tfdp's backups after the other callbacks."""
  signature = inspect.signature(original)

  @functools.wraps(original)
  def fit(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    bound.arguments["callbacks"] = runs_last(bound.arguments.get("callbacks"))
    callbacks = _listed(bound.arguments["callbacks"])
    wants = any(getattr(c, "wants_data_state", False) for c in callbacks)
    _stack().append(FitRun(self, wants, int(bound.arguments.get("epochs") or 1),
                           callbacks=callbacks))
    try:
      return original(*bound.args, **bound.kwargs)
    finally:
      _stack().pop()

  return fit


@contextlib.contextmanager
def _quiet_unless_chief(bound):
  """On a worker other than the chief: verbose=0, and Keras's own callbacks' messages off."""
  model = bound.arguments["self"]
  if os.environ.get(ALL_WORKERS_ENV) == "1" or _is_chief(model):
    yield
    return
  bound.arguments["verbose"] = 0
  loud = [c for c in _listed(bound.arguments.get("callbacks"))
          if type(c).__module__.startswith("keras.") and getattr(c, "verbose", 0)]
  saved = [c.verbose for c in loud]
  for c in loud:
    c.verbose = 0
  try:
    yield
  finally:
    for c, verbose in zip(loud, saved):
      c.verbose = verbose


def wrap_quiet(original):
  """`Trainer.fit`/`evaluate`/`predict` that print nothing on workers other than the chief."""
  signature = inspect.signature(original)

  @functools.wraps(original)
  def method(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    with _quiet_unless_chief(bound):
      return original(*bound.args, **bound.kwargs)

  return method


def wrap_epoch_iterator_init(original):
  """`TFEpochIterator.__init__` that gives the fit's training data checkpointable iterators."""

  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    original(self, *args, **kwargs)
    stack = _stack()
    run = stack[-1] if stack else None
    # The first epoch iterator a fit makes is its training data's.
    if run is None or run.epoch_iterator is not None:
      return
    run.epoch_iterator = self
    if run.wants_data_state:
      _swap_in_checkpointable(run, self)

  return __init__


def _swap_in_checkpointable(run: FitRun, epoch_iterator) -> None:
  adapter = type(epoch_iterator.data_adapter).__name__
  strategy = epoch_iterator._distribute_strategy  # pylint: disable=protected-access
  if adapter not in SERIALIZABLE_ADAPTERS:
    run.not_saved_reason = f"a {adapter} input runs Python code tf.data cannot save"
    return
  dataset = _checkpointable_input(run, epoch_iterator, adapter, strategy)
  if dataset is None:
    return
  # Keras makes at most 2 iterators per epoch (one as an epoch ends, one as
  # the next begins): after a restore each starts as in the saved run.
  dataset.later_iterators = 2 * run.epochs
  run.dataset = dataset
  epoch_iterator._distributed_dataset = dataset  # pylint: disable=protected-access
  logging.info("tfdp: the training data of this fit saves its position with each backup.")


def _checkpointable_input(run, epoch_iterator, adapter, strategy):
  """The checkpointable twin of the fit's training input, or None (why: `run.not_saved_reason`)."""
  dataset = epoch_iterator.data_adapter.get_tf_dataset()
  if not isinstance(dataset, tf.data.Dataset):  # Distributed by the user (e.g. tfdp.data).
    try:
      return iterators.checkpointable(dataset)
    except errors.ConfigError as e:
      run.not_saved_reason = f"the input is a distributed dataset tfdp cannot save: {e}"
      return None
  if not isinstance(epoch_iterator._distributed_dataset,  # pylint: disable=protected-access
                    (tf.distribute.DistributedDataset, tf.data.Dataset)):
    run.not_saved_reason = f"{type(strategy).__name__} does not distribute datasets"
    return None
  # Keras shuffles arrays with tf.random.shuffle, which draws the same
  # permutation in every new iterator; its kernel state needs no saving.
  policy = (tf.data.experimental.ExternalStatePolicy.IGNORE
            if adapter == "ArrayDataAdapter" else None)
  return iterators.checkpointable(dataset, strategy, external_state_policy=policy)


def wrap_enumerate_iterator(original):
  """`EpochIterator._enumerate_iterator` that can start an epoch at a later step."""

  @functools.wraps(original)
  def _enumerate_iterator(self):
    skip = getattr(self, "_tfdp_skip_steps", 0)
    self._tfdp_skip_steps = 0
    self._tfdp_skipped = skip  # This epoch's steps done before the resume.
    for item in original(self):
      if skip > 0:  # Counted as seen by Keras; its data is already consumed.
        skip -= self.steps_per_execution
        continue
      yield item

  return _enumerate_iterator


def wrap_metrics_or_logs(original):
  """`Trainer._get_metrics_result_or_logs` that gives the model's metrics for an epoch resumed after its last step.

  Such an epoch runs no step, so `fit` has no step logs to match the
  metrics' names against (upstream then logs nothing but validation); its
  metrics are the restored ones of the whole epoch.
  """

  @functools.wraps(original)
  def _get_metrics_result_or_logs(self, logs):
    run = current(self)
    ei = run.epoch_iterator if run is not None else None
    if isinstance(logs, dict) and not logs and getattr(ei, "_tfdp_skipped", 0) > 0:
      ei._tfdp_skipped = 0  # pylint: disable=protected-access
      return self.get_metrics_result()
    return original(self, logs)

  return _get_metrics_result_or_logs
