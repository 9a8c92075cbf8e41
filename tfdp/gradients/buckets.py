"""The gradient path's all-reduce: buckets in backward order, each one collective, optionally compressed.

`all_reduce(grads)` (in a replica context) sums the replicas' gradients as
`ReplicaContext.all_reduce(SUM, grads)` does, but in buckets: the gradients
are taken in reverse order (a Keras model's variables are in forward order,
so backward produces the last ones first), the first bucket holds at most
`first_bucket_mb` and the others at most `bucket_cap_mb`, and each bucket is
one `all_reduce` call whose inputs are only that bucket's gradients, so the
collective can start as soon as they exist while backward goes on, and the
updates of its variables need not wait for later buckets. The sum of each
element is the same with or without buckets (each element's replica values
are added the same way), so buckets change when bytes move, not the result.

With `compression`, each float32 gradient is cast to bfloat16 or float16
before its all-reduce and back after. `IndexedSlices` (sparse embedding
gradients) are reduced in one call of their own, uncompressed.

The settings come from tfdp.gradients (read when the step is traced).
"""

import tensorflow as tf

from tfdp.gradients import settings

_MB = 1 << 20
# Name scope of bucket k of n: f"{SCOPE}_{k}_of_{n}".
SCOPE = "tfdp_gradient_bucket"
_WIRE = {"bf16": tf.bfloat16, "fp16": tf.float16}


def _nbytes(t) -> int:
  n = t.shape.num_elements()
  return 0 if n is None else n * t.dtype.size


def plan(sizes: list[int], cap_bytes: int, first_bytes: int) -> list[list[int]]:
  """Buckets of indices into `sizes` (bytes), in reverse order.

  The first bucket closes once it holds `first_bytes` or more, each later one
  once it holds `cap_bytes` or more (a tensor larger than the cap is a bucket
  of its own). `cap_bytes` 0 is one bucket of everything.
  """
  order = list(range(len(sizes) - 1, -1, -1))
  if cap_bytes <= 0:
    return [order] if order else []
  buckets, current, filled = [], [], 0
  for i in order:
    current.append(i)
    filled += sizes[i]
    if filled >= (first_bytes if not buckets and first_bytes > 0 else cap_bytes):
      buckets.append(current)
      current, filled = [], 0
  if current:
    buckets.append(current)
  return buckets


def _options(pack_bytes=0):
  # No timeout here: TensorFlow keeps a timer thread per collective for the
  # whole timeout (see tfdp.liveness.stall, which keeps the deadline instead).
  return tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes)


def all_reduce(grads, config=None):
  """The replicas' sum of each gradient in `grads` (None stays None), in the calling replica context."""
  config = config or settings.current()
  ctx = tf.distribute.get_replica_context()
  out = list(grads)
  dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
  sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
  wire = _WIRE.get(config.compression)
  sizes = [_nbytes(grads[i]) for i in dense]
  buckets = plan(sizes, int(config.bucket_cap_mb * _MB), int(config.first_bucket_mb * _MB))
  for k, bucket in enumerate(buckets):
    indices = [dense[b] for b in bucket]
    # The name scope names the bucket in the graph, in profiles and in a
    # collective's timeout error.
    with tf.name_scope(f"{SCOPE}_{k + 1}_of_{len(buckets)}"):
      sent = [tf.cast(grads[i], wire) if wire is not None and grads[i].dtype == tf.float32
              else grads[i] for i in indices]
      # One pack per bucket (a pack size of 0 would leave the strategy's own
      # packing in force); with buckets off, the strategy's packing as upstream.
      pack = sum(_nbytes(t) for t in sent) + 1 if config.bucket_cap_mb > 0 else 0
      reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sent, options=_options(pack))
      for i, r in zip(indices, reduced):
        out[i] = tf.cast(r, grads[i].dtype) if r.dtype != grads[i].dtype else r
  if sparse:
    with tf.name_scope(f"{SCOPE}_sparse"):
      reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in sparse],
                               options=_options())
    for i, r in zip(sparse, reduced):
      out[i] = r
  return out
