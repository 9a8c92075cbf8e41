"""The per-replica input pipeline of a Source: the batch size each replica gets, one pipeline's dataset, and the distributed dataset."""

import tensorflow as tf

from tfdp import errors
from tfdp.data.sources import Source
from tfdp.data.sources import Transform
from tfdp.data.sources import steps_per_epoch


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
  """`global_batch_size / num_replicas`, or a ConfigError if it does not divide."""
  if global_batch_size < 1 or global_batch_size % num_replicas:
    raise errors.ConfigError(
        f"--global_batch_size={global_batch_size} must be a positive multiple "
        f"of the {num_replicas} replicas in sync (each replica gets an equal "
        f"slice); try {max(1, global_batch_size // num_replicas) * num_replicas}.")
  return global_batch_size // num_replicas


def replica_dataset(source: Source, *, global_batch_size: int, seed: int,
                    start_step: int = 0,
                    input_context: tf.distribute.InputContext | None = None,
                    shuffle: bool = True, transform: Transform | None = None) -> tf.data.Dataset:
  """The `tf.data.Dataset` one input pipeline feeds to its local replicas.

  It yields, for each global step from `start_step` on, one per-replica batch
  per local replica, in local-replica order: exactly the order in which
  `distribute_datasets_from_function` hands elements to the replicas of a
  worker. The dataset is infinite; the caller decides how many steps to run.

  Args:
    source: a `Source`: an `ArraySource`, `FunctionSource`, `TFRecordSource`
      or other `RandomAccessSource` (O(1) resume), or a `DatasetSource` (O(k)
      resume by skipping).
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

  Raises:
    ConfigError: the batch does not split evenly over the replicas and
      pipelines, or the data holds less than one global batch.
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
  options = tf.data.Options()
  options.deterministic = True
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  ds = source.replica_batches(
      global_batch_size=global_batch_size, seed=seed, start_step=start_step,
      input_context=input_context, shuffle=shuffle, transform=transform)
  return ds.prefetch(tf.data.AUTOTUNE).with_options(options)


def distribute(strategy: tf.distribute.Strategy, source: Source, *, global_batch_size: int,
               seed: int, start_step: int = 0, shuffle: bool = True,
               transform: Transform | None = None) -> tf.distribute.DistributedDataset:
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
