"""Deterministic, position-addressable input: the batch at step k is a pure function of (seed, k)."""

import dataclasses
import os
import struct

import numpy as np
import tensorflow as tf

from tfdp import errors


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """Examples held in memory: a nested structure of arrays with equal length.

  Attributes:
    features: dict, tuple or array; the first axis indexes examples.
    name: identity of the data, recorded in checkpoints.
  """
  features: object
  name: str = "arrays"

  def __post_init__(self):
    lengths = {len(a) for a in tf.nest.flatten(self.features)}
    if len(lengths) != 1:
      raise errors.ConfigError(
          f"ArraySource arrays must all have the same length, got {sorted(lengths)}.")

  @property
  def num_examples(self):
    return len(tf.nest.flatten(self.features)[0])

  def fetch(self, indices):
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
class FunctionSource:
  """Examples computed from their index: `fn(indices) -> batched structure`.

  `fn` must be a pure function of the indices (stateless random ops seeded by
  the index), which makes any position reachable in O(1).
  """
  fn: object
  num_examples: int
  name: str = "function"

  def fetch(self, indices):
    return self.fn(indices)


def tfrecord_index(paths):
  """(file, offset, length) of every record of uncompressed TFRecord files, in order.

  Reads only the 12-byte record headers (seeking past the data), once.

  Raises:
    ConfigError: a file is not an uncompressed TFRecord file.
  """
  files, offsets, lengths = [], [], []
  for file_id, path in enumerate(paths):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      pos = 0
      while pos < size:
        header = f.read(12)
        length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else -1
        if length < 0 or pos + 12 + length + 4 > size:
          raise errors.ConfigError(
              f"{path} is not an uncompressed TFRecord file (bad record header at "
              f"byte {pos}); random access needs uncompressed records. For "
              "compressed files use tfdp.data.DatasetSource(lambda: "
              "tf.data.TFRecordDataset(paths, compression_type=...).map(parse), "
              "num_examples=...), which resumes by skipping (O(k)).")
        files.append(file_id)
        offsets.append(pos + 12)
        lengths.append(length)
        pos += 12 + length + 4
        f.seek(pos)
  return (np.asarray(files, np.int64), np.asarray(offsets, np.int64),
          np.asarray(lengths, np.int64))


class TFRecordSource:
  """Records of uncompressed TFRecord files, read at any position in O(1).

  An index of record offsets (`tfrecord_index`, built once when the source
  is made) turns example i into one seek and read, so resuming at step k
  reads no record before it. Example i is the i-th record of `paths` taken
  in order.

  Args:
    paths: TFRecord files (a list, or one path).
    parse: `fn(records) -> batched structure`, records being a string
      vector, e.g. `lambda r: tf.io.parse_example(r, features)`.
    name: identity of the data, recorded in checkpoints (default: the file
      names and the record count).
  """

  def __init__(self, paths, parse, name=None):
    self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not self.paths:
      raise errors.ConfigError("TFRecordSource needs at least one file.")
    self.paths = [os.fspath(p) for p in self.paths]
    self.parse = parse
    self._files, self._offsets, self._lengths = tfrecord_index(self.paths)
    self.name = name or "tfrecord:{}:{}".format(
        ",".join(os.path.basename(p) for p in self.paths), self.num_examples)

  @property
  def num_examples(self):
    return len(self._offsets)

  def _read(self, indices):
    out = np.empty(len(indices), dtype=object)
    order = np.argsort(self._files[indices], kind="stable")
    handle, current = None, None
    try:
      for j in order:
        i = indices[j]
        file_id = self._files[i]
        if file_id != current:
          if handle:
            handle.close()
          handle, current = open(self.paths[file_id], "rb"), file_id
        handle.seek(self._offsets[i])
        out[j] = handle.read(self._lengths[i])
    finally:
      if handle:
        handle.close()
    return out

  def fetch(self, indices):
    records = tf.numpy_function(self._read, [indices], tf.string, stateful=False)
    records.set_shape([None])
    return self.parse(records)


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
  make_dataset: object
  num_examples: int
  name: str = "dataset"

  def replica_dataset(self, *, global_batch_size, start_step, input_context,
                      transform=None):
    """The per-replica batches of this pipeline's replicas from `start_step` on."""
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


def steps_per_epoch(num_examples, global_batch_size):
  """Full global batches in one pass over the data (the remainder is dropped)."""
  steps = num_examples // global_batch_size
  if steps < 1:
    raise errors.ConfigError(
        f"The dataset has {num_examples} examples, fewer than one global batch "
        f"of {global_batch_size}; lower --global_batch_size or use more data.")
  return steps


def example_indices(step, *, num_examples, global_batch_size, seed,
                    shuffle=True, replica=0, num_replicas=1):
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


def per_replica_batch_size(global_batch_size, num_replicas):
  """`global_batch_size / num_replicas`, or a ConfigError if it does not divide."""
  if global_batch_size < 1 or global_batch_size % num_replicas:
    raise errors.ConfigError(
        f"--global_batch_size={global_batch_size} must be a positive multiple "
        f"of the {num_replicas} replicas in sync (each replica gets an equal "
        f"slice); try {max(1, global_batch_size // num_replicas) * num_replicas}.")
  return global_batch_size // num_replicas


def replica_dataset(source, *, global_batch_size, seed, start_step=0,
                    input_context=None, shuffle=True, transform=None):
  """The `tf.data.Dataset` one input pipeline feeds to its local replicas.

  It yields, for each global step from `start_step` on, one per-replica batch
  per local replica, in local-replica order: exactly the order in which
  `distribute_datasets_from_function` hands elements to the replicas of a
  worker. The dataset is infinite; the caller decides how many steps to run.

  Args:
    source: an `ArraySource`, `FunctionSource`, `TFRecordSource` or anything
      with `num_examples` and `fetch(indices)` (O(1) resume), or a
      `DatasetSource` (O(k) resume by skipping).
    global_batch_size: examples per step across all replicas.
    seed: int seed of the order.
    start_step: first global step; resuming costs O(1) in it.
    input_context: the `tf.distribute.InputContext` (None: one pipeline, one
      replica).
    shuffle: permute each epoch.
    transform: optional `fn(batch, step) -> batch`, a pure function of its
      inputs (e.g. augmentation or masking seeded by the step).

  Returns:
    A `tf.data.Dataset` of per-replica batches.
  """
  if input_context is None:
    input_context = tf.distribute.InputContext()
  num_replicas = input_context.num_replicas_in_sync
  pipelines = input_context.num_input_pipelines
  if num_replicas % pipelines:
    raise errors.ConfigError(
        f"{num_replicas} replicas cannot be split evenly over {pipelines} "
        "input pipelines; every worker needs the same number of replicas.")
  per_replica_batch_size(global_batch_size, num_replicas)
  steps_per_epoch(source.num_examples, global_batch_size)
  local = num_replicas // pipelines
  options = tf.data.Options()
  options.deterministic = True
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  if isinstance(source, DatasetSource):
    return (source.replica_dataset(
        global_batch_size=global_batch_size, start_step=start_step,
        input_context=input_context, transform=transform)
            .prefetch(tf.data.AUTOTUNE).with_options(options))

  per_replica = global_batch_size // num_replicas

  def load(k):
    # One fetch per step for all local replicas (their slices of the global
    # batch are contiguous), then one element per replica.
    step = start_step + k
    indices = example_indices(
        step, num_examples=source.num_examples,
        global_batch_size=global_batch_size, seed=seed, shuffle=shuffle,
        replica=input_context.input_pipeline_id, num_replicas=pipelines)
    batch = source.fetch(indices)
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
  if local > 1:
    ds = ds.unbatch()
  return ds.prefetch(tf.data.AUTOTUNE).with_options(options)


def distribute(strategy, source, *, global_batch_size, seed, start_step=0,
               shuffle=True, transform=None):
  """A distributed dataset for `strategy` whose step k is the same on any topology.

  Pass it to `model.fit(..., steps_per_epoch=...)`; Keras keeps one iterator
  across epochs when `steps_per_epoch` is set, so element n is step
  `start_step + n`.
  """
  per_replica_batch_size(global_batch_size, strategy.num_replicas_in_sync)

  def fn(input_context):
    return replica_dataset(source, global_batch_size=global_batch_size,
                           seed=seed, start_step=start_step,
                           input_context=input_context, shuffle=shuffle,
                           transform=transform)

  return strategy.distribute_datasets_from_function(fn)


def synthetic_images(*, num_examples=2048, image_shape=(32, 32, 3),
                     num_classes=10, seed=0, noise=1.0):
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
