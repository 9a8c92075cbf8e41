"""Position-addressable sources: the Source protocol, sources read by index or as a stream, and which examples a step reads."""

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

from tfdp import errors

# `fn(batch, step) -> batch`, a pure function of its inputs (e.g. masking or
# augmentation seeded by the step), applied to each per-replica batch.
Transform = Callable[[Any, tf.Tensor], Any]


@runtime_checkable
class Source(Protocol):
  """What `replica_dataset` and `distribute` read: a named, sized set of examples.

  Each source builds the batches of one input pipeline itself, so how it
  reaches a step lives in the source: a `RandomAccessSource` fetches the
  examples of each step by index (resuming costs O(1)); a `DatasetSource`
  reads a stream and skips (O(k)).
  """

  @property
  def name(self) -> str:
    """Identity of the data, recorded in checkpoints."""

  @property
  def num_examples(self) -> int:
    """Examples in one epoch (all workers together)."""

  @property
  def random_access(self) -> bool:
    """Whether any step is reached in O(1) (else by reading and skipping, O(k))."""

  def replica_batches(self, *, global_batch_size: int, seed: int, start_step: int,
                      input_context: tf.distribute.InputContext, shuffle: bool,
                      transform: Transform | None) -> tf.data.Dataset:
    """The per-replica batches of `input_context`'s pipeline from `start_step` on.

    For each global step, one batch per local replica, in local-replica
    order; infinite. `replica_dataset` has checked the arguments and adds
    prefetching and the pipeline options.
    """


class RandomAccessSource:
  """Base of the sources that read any example by its index: subclasses define `fetch`.

  The examples of global step k are `example_indices(k, ...)`, so any step
  is reached in O(1). Subclasses also provide `name` and `num_examples`.
  """

  random_access = True

  def fetch(self, indices: tf.Tensor) -> Any:
    """The examples at `indices` (an int64 vector), batched."""
    raise NotImplementedError

  def replica_batches(self, *, global_batch_size: int, seed: int, start_step: int,
                      input_context: tf.distribute.InputContext, shuffle: bool,
                      transform: Transform | None) -> tf.data.Dataset:
    """See `Source.replica_batches`."""
    pipelines = input_context.num_input_pipelines
    local = input_context.num_replicas_in_sync // pipelines
    per_replica = global_batch_size // input_context.num_replicas_in_sync

    def load(k):
      # One fetch per step for all local replicas (their slices of the global
      # batch are contiguous), then one element per replica.
      step = start_step + k
      indices = example_indices(
          step, num_examples=self.num_examples,
          global_batch_size=global_batch_size, seed=seed, shuffle=shuffle,
          replica=input_context.input_pipeline_id, num_replicas=pipelines)
      batch = self.fetch(indices)
      if local == 1:
        return transform(batch, step) if transform else batch
      if not transform:  # [local * per_replica, ...] -> [local, per_replica, ...]
        def split(t):
          if t.shape[1:].is_fully_defined():
            return tf.reshape(t, [local, per_replica] + t.shape[1:].as_list())
          return tf.reshape(t, tf.concat([[local, per_replica], tf.shape(t)[1:]], 0))
        return tf.nest.map_structure(split, batch)
      parts = [transform(tf.nest.map_structure(
          lambda t, r=r: t[r * per_replica:(r + 1) * per_replica], batch), step)
               for r in range(local)]
      return tf.nest.map_structure(lambda *xs: tf.stack(xs), *parts)

    ds = tf.data.Dataset.counter(dtype=tf.int64).map(
        load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.unbatch() if local > 1 else ds


@dataclasses.dataclass(frozen=True)
class ArraySource(RandomAccessSource):
  """Examples held in memory: a nested structure of arrays with equal length.

  Attributes:
    features: dict, tuple or array; the first axis indexes examples.
    name: identity of the data, recorded in checkpoints.
  """
  features: Any
  name: str = "arrays"

  def __post_init__(self):
    lengths = {len(a) for a in tf.nest.flatten(self.features)}
    if len(lengths) != 1:
      raise errors.ConfigError(
          f"ArraySource arrays must all have the same length, got {sorted(lengths)}.")

  @property
  def num_examples(self) -> int:
    return len(tf.nest.flatten(self.features)[0])

  def fetch(self, indices: tf.Tensor) -> Any:
    """Examples at `indices` (an int64 vector), batched."""
    return tf.nest.map_structure(lambda a: tf.gather(a, indices),
                                 self._host_tensors())

  def _host_tensors(self):
    """The arrays as eager host tensors, made once, on first use.

    The input function captures them: an array turned into a constant inside
    the function would be serialized into its graph (1.5 s more to the first
    batch for 24 MB here, and a 2 GB limit). Made lazily, so creating the
    source does not initialise TensorFlow before `make_strategy`.
    """
    tensors = self.__dict__.get("_tensors")
    if tensors is None:
      with tf.init_scope(), tf.device("/cpu:0"):
        tensors = tf.nest.map_structure(tf.convert_to_tensor, self.features)
      object.__setattr__(self, "_tensors", tensors)
    return tensors


@dataclasses.dataclass(frozen=True)
class FunctionSource(RandomAccessSource):
  """Examples computed from their index: `fn(indices) -> batched structure`.

  `fn` must be a pure function of the indices (stateless random ops seeded by
  the index), which makes any position reachable in O(1).
  """
  fn: Callable[[tf.Tensor], Any]
  num_examples: int
  name: str = "function"

  def fetch(self, indices: tf.Tensor) -> Any:
    return self.fn(indices)


@dataclasses.dataclass(frozen=True)
class DatasetSource:
  """Any deterministic `tf.data.Dataset` of single examples: the documented O(k) fallback.

  The data cannot be addressed by position, so the order is the dataset's
  own, repeated every epoch (the `seed` and `shuffle` of the pipeline are
  not used), and starting at global step k skips k * global_batch_size
  examples: resuming costs O(k). Every worker reads the whole stream and
  keeps its replicas' slices, so the global batch at step k is the same on
  any topology. `make_dataset` must give the same order on every call and
  every worker (no unseeded shuffle, no non-deterministic interleave).

  Attributes:
    make_dataset: `fn() -> tf.data.Dataset` of single (unbatched) examples.
    num_examples: examples in one pass.
    name: identity of the data, recorded in checkpoints.
  """
  make_dataset: Callable[[], tf.data.Dataset]
  num_examples: int
  name: str = "dataset"

  random_access = False

  def replica_batches(self, *, global_batch_size: int, seed: int, start_step: int,
                      input_context: tf.distribute.InputContext, shuffle: bool,
                      transform: Transform | None) -> tf.data.Dataset:
    """See `Source.replica_batches`; `seed` and `shuffle` are not used (the stream's own order)."""
    del seed, shuffle
    replicas = input_context.num_replicas_in_sync
    per_replica = global_batch_size // replicas
    local = replicas // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local
    ds = self.make_dataset().repeat().skip(start_step * global_batch_size)
    ds = ds.batch(global_batch_size, drop_remainder=True)

    def split(offset, batch):
      step = start_step + offset
      parts = [tf.nest.map_structure(lambda t, r=r: t[r * per_replica:(r + 1) * per_replica],
                                     batch) for r in range(first, first + local)]
      if transform:
        parts = [transform(p, step) for p in parts]
      return tf.data.Dataset.from_tensor_slices(
          tf.nest.map_structure(lambda *xs: tf.stack(xs), *parts))

    return ds.enumerate().flat_map(split)


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
  """Full global batches in one pass over the data (the remainder is dropped)."""
  steps = num_examples // global_batch_size
  if steps < 1:
    raise errors.ConfigError(
        f"The dataset has {num_examples} examples, fewer than one global batch "
        f"of {global_batch_size}; lower --global_batch_size or use more data.")
  return steps


def example_indices(step: int | tf.Tensor, *, num_examples: int, global_batch_size: int,
                    seed: int, shuffle: bool = True, replica: int | tf.Tensor = 0,
                    num_replicas: int = 1) -> tf.Tensor:
  """Indices of the examples replica `replica` sees at global step `step`.

  The global batch at `step` is positions [i*G, (i+1)*G) of epoch
  e = step // steps_per_epoch (i = step % steps_per_epoch), under the
  permutation of epoch e derived from (seed, e) alone; replica r takes the
  r-th of `num_replicas` equal slices. So the examples of a global batch do
  not depend on the topology, and any step is reachable in O(1).

  Args:
    step: scalar int64 tensor or int, the global step.
    num_examples: size of the dataset.
    global_batch_size: examples per step across all replicas.
    seed: int seed of the run.
    shuffle: permute each epoch; False walks the data in order.
    replica: global replica id (scalar tensor or int).
    num_replicas: replicas in sync.

  Returns:
    int64 vector of length global_batch_size // num_replicas.
  """
  per_replica = global_batch_size // num_replicas
  spe = num_examples // global_batch_size
  step = tf.cast(step, tf.int64)
  epoch = step // spe
  first = (step % spe) * global_batch_size + tf.cast(replica, tf.int64) * per_replica
  positions = first + tf.range(per_replica, dtype=tf.int64)
  if not shuffle:
    return positions
  key = tf.stack([tf.constant(seed, tf.int64), epoch])
  return tf.random.experimental.index_shuffle(
      positions, seed=key, max_index=num_examples - 1)


def synthetic_images(*, num_examples: int = 2048, image_shape: tuple = (32, 32, 3),
                     num_classes: int = 10, seed: int = 0, noise: float = 1.0) -> FunctionSource:
  """Images with a learnable signal: a fixed per-class template plus noise.

  Each example is a pure function of (seed, index), computed on the fly, so
  the data needs no memory and any position costs the same.

  Returns:
    A `FunctionSource` of `(image float32 [H, W, C], label int32)`.
  """
  templates = np.random.default_rng(seed).normal(
      size=(num_classes,) + tuple(image_shape)).astype(np.float32)

  def fn(indices):
    labels = tf.cast(
        tf.random.experimental.index_shuffle(
            indices, seed=[seed, -1], max_index=num_examples - 1) % num_classes,
        tf.int32)

    def one(index):
      return tf.random.stateless_normal(
          image_shape, seed=tf.stack([tf.constant(seed, tf.int64), index]))

    images = tf.map_fn(one, indices, fn_output_signature=tf.float32)
    images = tf.gather(tf.constant(templates), labels) + noise * images
    return images, labels

  return FunctionSource(fn, num_examples,
                        name=f"synthetic_images:{num_examples}:{'x'.join(map(str, image_shape))}:{num_classes}:{seed}")
