"""Interaction (recommendation) data sharded by file per worker: worker w of N reads files w, w+N, ....

`AutoShardPolicy.FILE` semantics over a split whose files are known: each
worker reads global_batch_size / N examples per step from its own files and
nothing else, so its data position is a pure function of the global step.
No per-worker state needs checkpointing, but resuming on another number of
workers changes which worker reads what (the dataset name records N, so the
checkpoint's run config refuses that unless --allow_config_mismatch).
"""

from typing import Callable

import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp import errors


def worker_indices(shard_lengths: list[int], worker: int, num_workers: int) -> np.ndarray:
  """Example indices of the files worker `worker` reads: files worker, worker + N, ....

  `AutoShardPolicy.FILE` semantics over a split whose file f holds
  `shard_lengths[f]` consecutive examples.

  Raises:
    ConfigError: fewer files than workers.
  """
  if len(shard_lengths) < num_workers:
    raise errors.ConfigError(
        f"{len(shard_lengths)} file(s) cannot be shared by {num_workers} workers; "
        "each worker reads whole files. Write the data in at least as many files as "
        "workers, or use fewer workers.")
  starts = np.concatenate([[0], np.cumsum(shard_lengths)])
  return np.concatenate([np.arange(starts[f], starts[f + 1], dtype=np.int64)
                         for f in range(worker, len(shard_lengths), num_workers)])


def worker_files_error(spec: str, split: str, num_files: int, num_workers: int) -> str:
  """The message for a TFDS split with fewer files than workers."""
  return (f"TFDS dataset {spec!r} split {split!r} has {num_files} file(s), fewer than "
          f"the {num_workers} workers; each worker reads whole files. Write it with at "
          f"least {num_workers} shards (scripts/make_dataset.py --num_shards="
          f"{num_workers}) or use fewer workers.")


class FileShardedSource:
  """A `tfdp.data.Source` whose workers each read their own files.

  Args:
    shard_lengths: examples in each file of the split, in order.
    make_source: `fn(indices, name) -> source` reading the examples at
      `indices` of the split (random access).
    num_examples: examples of the split (all files).
    name: identity of the data, recorded in checkpoints.
  """

  random_access = True

  def __init__(self, shard_lengths: list[int],
               make_source: Callable[[np.ndarray, str], data.Source], *,
               num_examples: int, name: str):
    self._lengths = list(shard_lengths)
    self._make_source = make_source
    self.num_examples = num_examples
    self.name = name

  def for_worker(self, worker: int, num_workers: int) -> data.Source:
    """The source of the files worker `worker` of `num_workers` reads.

    Raises:
      ConfigError: fewer files than workers.
    """
    return self._make_source(worker_indices(self._lengths, worker, num_workers),
                             f"{self.name}:worker{worker}of{num_workers}")

  def replica_batches(self, *, global_batch_size: int, seed: int, start_step: int,
                      input_context: tf.distribute.InputContext, shuffle: bool,
                      transform: data.Transform | None) -> tf.data.Dataset:
    """See `tfdp.data.Source.replica_batches`: the batches of this pipeline's worker's files."""
    workers = input_context.num_input_pipelines
    local = input_context.num_replicas_in_sync // workers
    source = self.for_worker(input_context.input_pipeline_id, workers)
    # This worker's files are a dataset of their own, read by its local
    # replicas only: one pipeline, `local` replicas, G / N examples a step.
    data.steps_per_epoch(source.num_examples, global_batch_size // workers)
    return source.replica_batches(
        global_batch_size=global_batch_size // workers, seed=seed, start_step=start_step,
        input_context=tf.distribute.InputContext(1, 0, local), shuffle=shuffle,
        transform=transform)
