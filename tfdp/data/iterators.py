"""Checkpointable distributed iterators for any `tf.data` pipeline, one state per worker.

TensorFlow cannot checkpoint the iterator of a distributed dataset: the
per-worker iterator inside a `DistributedIterator` is an
`OwnedMultiDeviceIterator`, which has no serialization and holds elements
already taken from the pipeline in its per-device buffers. `checkpointable`
keeps everything else of TF's distributed dataset (its auto-sharding over
workers, its rebatching into per-replica batches, its handling of partial
batches at the end of a finite dataset and the cross-worker agreement on that
end) and replaces only that per-worker iterator: a plain `tf.data` iterator on
the worker's host, from which each step takes one element per local replica,
in the order TF's multi-device iterator hands them out (element k to local
replica k mod n). Nothing is in flight outside the pipeline, so the state of
that one iterator (which `tf.data` serializes with its shuffle buffers, RNG
state, interleave cycle and prefetched elements) is the exact data position.
"""

from __future__ import annotations

import threading
import weakref

from absl import logging
import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.distribute import input_lib
from tensorflow.python.trackable import base as trackable_base

from tfdp import errors
from tfdp.data import iterator_state
from tfdp.data import worker_iterator



class _SavedPosition:
  """`state()` / `restore_state()` and the trackable's save and restore, over one iterator resource (`_resource_of()`)."""

  _dataset = None

  def _resource_of(self):
    raise NotImplementedError

  def state(self) -> bytes:
    """The serialized position of this worker's iterator (bytes)."""
    return self.state_tensor().numpy()

  def state_tensor(self) -> tf.Tensor:
    """`state()` as a string tensor (no copy to Python)."""
    return iterator_state.serialize(self._resource_of(), self._dataset)

  def state_variant(self) -> tf.Tensor:
    """This worker's position as a variant snapshot, not yet bytes (see `iterator_state.capture`)."""
    return iterator_state.capture(self._resource_of(), self._dataset)

  def restore_state(self, state: bytes) -> None:
    """Moves this worker's iterator to a position `state()` returned."""
    iterator_state.deserialize(self._resource_of(), state)

  def _serialize_to_tensors(self):
    # The variant: tf.train.Checkpoint writes it as it is, tfdp's writer
    # turns it into bytes off the training thread.
    return {"state": self.state_variant()}

  def _restore_from_tensors(self, restored_tensors):
    iterator_state.restore(self._resource_of(), restored_tensors["state"])
    return []


class _CheckpointableIteratorSpec(input_lib.DistributedIteratorSpec):
  """TypeSpec of `CheckpointableIterator`: passes through `tf.function` like TF's."""

  @property
  def value_type(self):
    return CheckpointableIterator

  @property
  def _component_specs(self):
    return [worker_iterator.HostFedWorkerIteratorSpec(s._worker, s._devices, s._element_spec, s._options,  # pylint: disable=protected-access
                                       s._canonicalize_devices)  # pylint: disable=protected-access
            for s in super()._component_specs]

  def _from_components(self, components):
    it = CheckpointableIterator(
        input_workers=self._input_workers, iterators=None, components=components,
        element_spec=self._element_spec, strategy=self._strategy,
        cardinality=self._cardinality,
        enable_get_next_as_optional=self._enable_get_next_as_optional,
        options=self._options, replica_order=self._replica_order)
    return it

  @staticmethod
  def from_value(value):
    return value._type_spec  # pylint: disable=protected-access


class CheckpointableIterator(_SavedPosition, input_lib.DistributedIterator,
                             trackable_base.Trackable):
  """A `tf.distribute` iterator whose position can be saved and restored.

  It yields what `iter(strategy.experimental_distribute_dataset(ds))` yields,
  and is a trackable: put it in a `tf.train.Checkpoint` on one worker, or in
  the `per_worker` state of a `tfdp.CheckpointManager` in a multi-worker job
  (its state differs between workers). `state()` / `restore_state()` give the
  serialized position of this worker's part.
  """

  _dataset: "CheckpointableDataset | None" = None
  _index: int = 0  # 1 for the first iterator its dataset made.

  @property
  def _type_spec(self):
    return _CheckpointableIteratorSpec(
        self._input_workers, self._element_spec, self._strategy, self._options,
        cardinality=self._cardinality,
        enable_get_next_as_optional=self._enable_get_next_as_optional,
        replica_order=self._replica_order)

  def _resources(self):
    return [w._iterator._iterator_resource for w in self._iterators]  # pylint: disable=protected-access

  def _resource_of(self):
    (resource,) = self._resources()
    return resource

  def skip_steps(self, steps: int) -> None:
    """Takes what `steps` training steps take from this worker's iterator (one element per local replica)."""
    (worker,) = self._iterators
    iterator_state.take(worker._iterator, steps * len(worker._devices))  # pylint: disable=protected-access


class _MakesIterators:
  """What both checkpointable datasets do: count their iterators, start the next at a saved position.

  Each new iterator of a pipeline with `shuffle(seed=...)` draws that
  shuffle's seeds from a generator the dataset keeps, so an iterator's order
  depends on how many were made before it: a resumed run makes as many
  before the one it restores. Restoring an iterator's state sets that
  generator back to where the saved run had it, but not always (TF 2.21:
  when an asynchronous transformation, a parallel map, interleave or batch,
  reads from a `prefetch` and is read by one, e.g. Keras's `class_weight`
  map after a pipeline that ends in `prefetch`, the restore draws once more
  instead; which happens can vary between runs). So before it restores one,
  it takes the fresh states of the `later_iterators` iterators the saved run
  makes next (their seeds drawn in order), and gives them to the iterators
  it makes after: those start as the saved run's did, whatever the restore
  did to the generator.
  """

  def _setup(self, external_state_policy):
    self.external_state_policy = external_state_policy
    self.iterators_made = 0
    self._current = None  # A weak reference: see `current`.
    # How many iterators after a restored one start from states taken before
    # the restore (tfdp.resume.fit_hooks: 2 per epoch of the fit, what Keras makes).
    self.later_iterators = 0
    self._later_states = []
    self._restored = False
    self._pending = None
    self._lock = threading.Lock()

  @property
  def current(self):
    """The newest iterator made, while something else (Keras's fit, the user's loop) holds it; else None.

    Held weakly, as `fit` holds its iterator: the iterator refers to this
    dataset, so a strong reference would make a cycle that only Python's
    cyclic GC frees. Until then the iterator's buffers stay in memory, and
    its end falls on whatever code runs that collection. Freeing a tf.data
    iterator can take seconds there (TF 2.21: the iterator's autotuning
    thread may miss the wake-up of its cancellation and sleep out its
    period, up to 60 s, while the freeing thread holds the GIL).
    """
    return self._current() if self._current is not None else None

  def set_pending(self, state: bytes | None, iterators_made: int, skip_steps: int = 0) -> None:
    """The next iterator made starts at `state` (None: fresh), as the `iterators_made`+1-th.

    Then it takes `skip_steps` steps' elements (a position saved as an
    earlier state plus the steps since).
    """
    with self._lock:
      self._pending = (state, iterators_made, skip_steps)

  def __iter__(self):
    if not tf.executing_eagerly():
      return super().__iter__()
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is None:
      it = self._make()
      if self._later_states:
        it.restore_state(self._later_states.pop(0))
      elif self._restored:
        self._restored = False
        logging.warning(
            "tfdp: this input made more iterators after a resume than were prepared "
            "(%d); from here its shuffle order may differ from an uninterrupted run's.",
            self.later_iterators)
      return it
    state, made, skip = pending
    # A fresh iterator draws the same shuffle seeds as the one it replaces
    # only if as many iterators were made before it.
    while self.iterators_made < made:
      self._make()
    it = self._make()
    self._later_states, self._restored = [], False
    if state:
      for _ in range(self.later_iterators):
        probe = self._new_iterator()
        probe._dataset = self  # pylint: disable=protected-access
        self._later_states.append(probe.state_tensor())
      self._restored = True
      it.restore_state(state)
    it.skip_steps(skip)
    return it

  def _make(self):
    it = self._new_iterator()
    it._dataset = self  # pylint: disable=protected-access
    self.iterators_made += 1
    it._index = self.iterators_made  # pylint: disable=protected-access
    self._current = weakref.ref(it)
    return it


class _HostFed(_MakesIterators):
  """A tf.distribute dataset whose iterators feed the replicas from host iterators."""

  def _worker_datasets(self):
    raise NotImplementedError

  def _new_iterator(self):
    canonicalize = getattr(self._strategy, "_canonicalize_devices", True)
    workers = [
        worker_iterator.HostFedWorkerIterator(dataset=ds, worker=worker, devices=devices,
                               options=self._options, canonicalize_devices=canonicalize)
        for ds, (worker, devices) in zip(
            self._worker_datasets(),
            ((w, self._input_workers.compute_devices_for_worker(i))
             for i, w in enumerate(self._input_workers.worker_devices)))]
    it = CheckpointableIterator(
        self._input_workers, workers, self._strategy, cardinality=self._cardinality,
        enable_get_next_as_optional=self._enable_get_next_as_optional,
        options=self._options, replica_order=self._replica_order)
    it._element_spec = self._element_spec  # pylint: disable=protected-access
    return it


class CheckpointableDataset(_HostFed, input_lib.DistributedDataset):
  """A distributed dataset whose iterators are `CheckpointableIterator`s.

  Made by `checkpointable()`. It counts the iterators it made (each draws new
  seeds from the pipeline's `shuffle` seed generators), and it can be given a
  saved position for the next iterator it makes (`set_pending`).
  """

  def _worker_datasets(self):
    return self._cloned_datasets


class CheckpointableDatasetsFromFunction(_HostFed, input_lib.DistributedDatasetsFromFunction):
  """`strategy.distribute_datasets_from_function` with `CheckpointableIterator`s."""

  def _worker_datasets(self):
    return self._datasets


class LocalIterator(_SavedPosition, iterator_ops.OwnedIterator):
  """A `tf.data` iterator with `state()` / `restore_state()` (no strategy: one device)."""

  _dataset = None
  _index = 0

  def _resource_of(self):
    return self._iterator_resource

  def skip_steps(self, steps: int) -> None:
    """Takes what `steps` training steps take (one element each)."""
    iterator_state.take(self, steps)


class LocalDataset(_MakesIterators):
  """`checkpointable()` without a distribution strategy: a dataset making `LocalIterator`s."""

  def __init__(self, dataset: tf.data.Dataset):
    self.dataset = dataset
    self.element_spec = dataset.element_spec

  def _new_iterator(self):
    return LocalIterator(self.dataset)


def checkpointable(dataset: tf.data.Dataset, strategy: tf.distribute.Strategy | None = None,
                   options: tf.distribute.InputOptions | None = None, *,
                   external_state_policy=None) -> CheckpointableDataset:
  """Distributes `dataset` like `strategy.experimental_distribute_dataset`, with checkpointable iterators.

  Use it where a custom loop calls `experimental_distribute_dataset`:

      dist = tfdp.data.checkpointable(dataset, strategy)
      iterator = iter(dist)
      manager = tfdp.CheckpointManager(ckpt, directory, per_worker={"data": iterator})

  Every element is the one TF's distributed dataset yields (the same
  sharding over workers, the same split into per-replica batches). Elements
  are copied to the replicas' devices inside the step, not prefetched to
  them ahead of it.

  Args:
    dataset: a `tf.data.Dataset` of global batches (as for
      `experimental_distribute_dataset`), or a distributed dataset not yet
      iterated (from `experimental_distribute_dataset` or
      `distribute_datasets_from_function`, e.g. `tfdp.data.distribute`).
    strategy: default: the strategy in scope.
    options: `tf.distribute.InputOptions` (per-worker replication only).
    external_state_policy: how to save state tf.data cannot serialize (a
      `tf.data.experimental.ExternalStatePolicy`); default: the dataset's
      option, or FAIL.

  Returns:
    A `CheckpointableDataset` (a `tf.distribute.DistributedDataset`), or
    without a strategy a `LocalDataset` of `LocalIterator`s.
  """
  if isinstance(dataset, (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction)):
    return _convert(dataset, external_state_policy or options_lib.ExternalStatePolicy.FAIL)
  strategy = strategy or tf.distribute.get_strategy()
  if options is not None and (options.experimental_replication_mode
                              != tf.distribute.InputReplicationMode.PER_WORKER):
    raise errors.ConfigError(
        "tfdp.data.checkpointable supports InputReplicationMode.PER_WORKER only.")
  reasons = iterator_state.nondeterminism(dataset)
  if reasons:
    logging.warning(
        "tfdp: an exact resume needs a deterministic input order, but %s; the "
        "position is restored, the elements after it may differ from an "
        "uninterrupted run's.", "; ".join(reasons))
  policy = (external_state_policy or dataset.options().experimental_external_state_policy
            or options_lib.ExternalStatePolicy.FAIL)
  dist = strategy.experimental_distribute_dataset(dataset, options)
  if isinstance(dist, tf.data.Dataset):  # The default strategy: one device.
    out = LocalDataset(dist)
    out._setup(policy)  # pylint: disable=protected-access
    return out
  if not isinstance(dist, input_lib.DistributedDataset):
    raise errors.ConfigError(
        f"{type(strategy).__name__} does not distribute through tf.distribute's "
        "DistributedDataset; tfdp.data.checkpointable needs (MultiWorker)MirroredStrategy, "
        "OneDeviceStrategy or no strategy.")
  return _convert(dist, policy)


def _convert(dist, policy):
  """The checkpointable twin of a tf.distribute dataset (iterators are made later, by it)."""
  if isinstance(dist, _MakesIterators):
    return dist
  if (dist._options is not None and dist._options.experimental_replication_mode  # pylint: disable=protected-access
      != tf.distribute.InputReplicationMode.PER_WORKER):
    raise errors.ConfigError(
        "tfdp.data.checkpointable supports InputReplicationMode.PER_WORKER only.")
  cls = (CheckpointableDataset if isinstance(dist, input_lib.DistributedDataset)
         else CheckpointableDatasetsFromFunction)
  out = cls.__new__(cls)
  out.__dict__.update(dist.__dict__)
  out._setup(policy)  # pylint: disable=protected-access
  return out
