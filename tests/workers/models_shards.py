"""Worker of the recommender sharding test: reads one epoch of its file shard under MWMS, writes what it saw."""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
  data_dir, out_dir, global_batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
  import models  # pylint: disable=g-import-not-at-top
  from tfdp import cluster  # pylint: disable=g-import-not-at-top
  from tfdp import datasets  # pylint: disable=g-import-not-at-top
  from tfdp.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  strategy = strategy_lib.make_strategy("multi_worker")
  me = cluster.resolve(strategy)
  worker, workers = me.index, me.count
  dataset = datasets.load("tfds:tfdp_interactions", task=models.RECOMMENDATION, data_dir=data_dir,
                          num_workers=workers)
  mine = dataset.source.for_worker(worker, workers).num_examples
  steps = mine // (global_batch // workers)
  it = iter(dataset.distribute(strategy, global_batch_size=global_batch, seed=0))
  rows = []
  for _ in range(steps):
    features, _ = next(it)
    for part in strategy.experimental_local_results(features["dense"]):
      rows.append(part.numpy())
  del it  # stop the prefetching input pipeline before the interpreter exits
  np.save(os.path.join(out_dir, f"worker{worker}.npy"), np.concatenate(rows))
  print("SHARD " + json.dumps({"worker": worker, "examples": mine, "name": dataset.name}),
        flush=True)


if __name__ == "__main__":
  main()
