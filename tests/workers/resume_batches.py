"""Next-batches worker: consume K batches, checkpoint the position; or restore it in a new process and read on.

Usage: resume_batches.py OUT_DIR first|second K M
"""

import os
import sys

import numpy as np
import tensorflow as tf

import tfdp
from tfdp import cluster


def main(out_dir, phase, k, m):
  strategy = tfdp.make_strategy("multi_worker")
  worker = cluster.resolve(strategy).index
  source = tfdp.data.synthetic_images(num_examples=96, image_shape=(4, 4, 1), seed=5)
  step = tf.Variable(0, dtype=tf.int64)
  manager = tfdp.CheckpointManager(tf.train.Checkpoint(step=step),
                                   os.path.join(out_dir, "ckpt"), strategy=strategy)
  if phase == "second":
    manager.restore()
  start = int(step.numpy())

  def distributed():
    return iter(tfdp.data.distribute(strategy, source, global_batch_size=8, seed=3,
                                     start_step=start))

  batches = []
  it = distributed()
  for n in range(start, k + m if phase == "first" else start + m):
    images, labels = next(it)
    if phase == "first" and n == k:
      manager.save(checkpoint_number=k)
    step.assign(n + 1)
    if n >= k:
      batches.append([np.stack([t.numpy() for t in strategy.experimental_local_results(x)])
                      for x in (images, labels)])
  np.savez(os.path.join(out_dir, f"{phase}_w{worker}.npz"),
           images=np.stack([b[0] for b in batches]),
           labels=np.stack([b[1] for b in batches]), start=start)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
