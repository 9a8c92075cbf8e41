"""Each worker gives tfdp.CheckpointManager a directory in its own process's memory (ram://), which no other worker sees.

Usage: dir_mismatch.py TAG SAME. SAME=1: every worker names the same
ram:// path (each still sees only its own); 0: each names its own. Prints
"failed after <s>s: <error>" and exits 2 when the manager refuses.
"""

import sys
import time

import tensorflow as tf

import tfdp

strategy = tfdp.make_strategy()
task = strategy.cluster_resolver.task_id
with strategy.scope():
  v = tf.Variable(1.0)
where = "w" if sys.argv[2] == "1" else f"w{task}"
start = time.monotonic()
try:
  tfdp.CheckpointManager(tf.train.Checkpoint(v=v), f"ram://tfdp-{sys.argv[1]}-{where}/ckpt")
except tfdp.errors.CheckpointError as e:
  print(f"failed after {time.monotonic() - start:.1f}s: {e}", flush=True)
  sys.exit(2)
print("started", flush=True)
