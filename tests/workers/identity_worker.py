"""Worker of the shared 2-worker run: the strategy's replicas and all-reduce, who am I (tfdp.cluster), agree().

Prints one `RESULT <part> ...` line per part (strategy, cluster);
tests/identity_run.py hands each part to the test file that checks it.
"""

import keras
import tensorflow as tf

from tfdp import cluster
from tfdp.distribute import environment
from tfdp import errors
from tfdp.distribute import strategy as strategy_lib


def strategy_part(s):
  """tests/test_strategy.py: replicas in sync, who this worker is, one ring all-reduce, the pack size."""
  ctx = tf.distribute.get_replica_context
  r = s.run(lambda: ctx().all_reduce("SUM", tf.cast(ctx().replica_id_in_sync_group, tf.float32)))
  me = cluster.resolve(s)
  pack = s.extended._communication_options.bytes_per_pack  # pylint: disable=protected-access
  return " ".join(str(x) for x in (
      type(s).__name__, s.num_replicas_in_sync, (me.index, me.count, me.is_chief),
      [float(x) for x in s.experimental_local_results(r)], "pack", pack))


def cluster_part(s):
  """tests/test_cluster.py: resolve() by strategy, in scope and by variables; the refusal; agree()."""
  with s.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  checkpoint = tf.train.Checkpoint(model=model, step=tf.Variable(0))
  w = cluster.resolve(s)
  try:
    cluster.resolve()
    refused = False
  except errors.ConfigError:
    refused = True
  by_objects = cluster.resolve(objects=checkpoint)
  v = 10.0 + w.index
  with s.scope():
    in_scope_sum = cluster.agree(v, "sum")
  nonce = 2.0 ** 50 + 3 if w.is_chief else 0.0
  return " ".join(str(x) for x in (
      w.index, w.count, w.is_chief, w.task, w.peers, refused,
      by_objects == w, cluster.peers(s) == w.peers,
      cluster.agree(v, "max", s), cluster.agree(v, "min", s), in_scope_sum,
      cluster.agree(nonce, "sum", s) == 2.0 ** 50 + 3,
      w.address == environment.parse_tf_config()["cluster"]["worker"][w.index]))


def main():
  s = strategy_lib.make_strategy("auto", cpu_replicas=2, all_reduce="ring", timeout_seconds=60)
  print("RESULT strategy", strategy_part(s), flush=True)
  print("RESULT cluster", cluster_part(s), flush=True)


if __name__ == "__main__":
  main()
