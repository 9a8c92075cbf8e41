"""DLRM (Naumov et al. 2019): embedding tables, bottom MLP, dot interactions, top MLP."""

import itertools

import keras
from keras import ops


def build(vocab_sizes=None, num_dense=8, embedding_dim=16, bottom_mlp=(64, 32),
          top_mlp=(64, 32), seed=0):
  """A DLRM that outputs a float32 logit [B, 1] per interaction (click/like or not).

  Inputs (a dict): `dense` [B, num_dense] float32 and one int id [B] per
  categorical feature in `vocab_sizes` (e.g. `user`, `item`).

  Args:
    vocab_sizes: dict feature name -> table size (default user/item of 1000).
    num_dense: number of dense features.
    embedding_dim: width of every embedding and of the bottom MLP's output.
    bottom_mlp: hidden widths of the bottom MLP (embedding_dim is appended).
    top_mlp: hidden widths of the top MLP (a 1-unit output is appended).
    seed: seed of the initialisers.

  Returns:
    An uncompiled `keras.Model`.
  """
  vocab_sizes = dict(vocab_sizes or {"user": 1000, "item": 1000})
  count = [0]

  def init(kind="glorot"):
    count[0] += 1
    s = seed * 1000 + count[0]
    if kind == "embedding":
      return keras.initializers.RandomUniform(-0.05, 0.05, seed=s)
    return keras.initializers.GlorotUniform(seed=s)

  dense = keras.Input((num_dense,), dtype="float32", name="dense")
  x = dense
  for i, width in enumerate(tuple(bottom_mlp) + (embedding_dim,)):
    x = keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                           name=f"bottom_{i}")(x)
  inputs = {"dense": dense}
  vectors = [x]
  for name, size in sorted(vocab_sizes.items()):
    inputs[name] = keras.Input((), dtype="int32", name=name)
    vectors.append(keras.layers.Embedding(size, embedding_dim, embeddings_initializer=init("embedding"),
                                          name=f"{name}_embedding")(inputs[name]))
  # Dot products of every pair of vectors (the strict upper triangle of X X^T).
  stacked = ops.stack(vectors, axis=1)  # [B, n, D]
  gram = ops.matmul(stacked, ops.transpose(stacked, (0, 2, 1)))
  n = len(vectors)
  pairs = [i * n + j for i, j in itertools.combinations(range(n), 2)]
  dots = ops.take(ops.reshape(gram, (-1, n * n)), pairs, axis=1)
  y = ops.concatenate([x, dots], axis=1)
  for i, width in enumerate(top_mlp):
    y = keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                           name=f"top_{i}")(y)
  logit = keras.layers.Dense(1, kernel_initializer=init(), dtype="float32", name="logit")(y)
  return keras.Model(inputs, logit, name="dlrm")
