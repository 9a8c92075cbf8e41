"""BERT encoder (post-LN Transformer) with a masked-LM head tied to the token embeddings."""

import dataclasses

import keras
from keras import ops


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Sizes of one BERT variant (Turc et al.'s small BERTs and BERT-base)."""
  layers: int
  hidden: int
  heads: int
  intermediate: int
  max_positions: int = 512
  type_vocab_size: int = 2
  dropout: float = 0.1


CONFIGS = {
    "tiny": BertConfig(layers=2, hidden=128, heads=2, intermediate=512),
    "mini": BertConfig(layers=4, hidden=256, heads=4, intermediate=1024),
    "small": BertConfig(layers=4, hidden=512, heads=8, intermediate=2048),
    "base": BertConfig(layers=12, hidden=768, heads=12, intermediate=3072),
}

BASE_VOCAB_SIZE = 30522  # the uncased English WordPiece vocabulary of BERT-base


class TiedEmbedding(keras.layers.Layer):
  """Token embeddings that also project hidden states back to vocabulary logits.

  Called as `layer(ids)` it looks tokens up; as `layer(x, mode="logits")` it
  returns `x @ embeddings^T + bias` in float32 (the MLM output layer shares
  the input embeddings, as in BERT).
  """

  def __init__(self, vocab_size, hidden, seed=0, **kwargs):
    super().__init__(**kwargs)
    self.vocab_size = vocab_size
    self.hidden = hidden
    self.seed = seed

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        shape=(self.vocab_size, self.hidden), name="embeddings",
        initializer=keras.initializers.TruncatedNormal(stddev=0.02, seed=self.seed))
    self.output_bias = self.add_weight(shape=(self.vocab_size,), name="output_bias",
                                       initializer="zeros")

  def call(self, inputs, mode="embed"):
    if mode == "embed":
      return ops.take(self.embeddings, ops.cast(inputs, "int32"), axis=0)
    logits = ops.matmul(inputs, ops.transpose(self.embeddings)) + self.output_bias
    return ops.cast(logits, "float32")

  def compute_output_spec(self, inputs, mode="embed"):
    if mode == "embed":
      return keras.KerasTensor(tuple(inputs.shape) + (self.hidden,), self.compute_dtype)
    return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.vocab_size,), "float32")

  def get_config(self):
    return dict(super().get_config(), vocab_size=self.vocab_size,
                hidden=self.hidden, seed=self.seed)


def build(bert_config="tiny", vocab_size=BASE_VOCAB_SIZE, seq_len=128,
          max_predictions=20, seed=0):
  """BERT encoder + masked-LM head; outputs float32 logits at the masked positions.

  Inputs (a dict): `input_ids` [B, seq_len] int32, `input_mask` [B, seq_len]
  (1 for real tokens, 0 for padding) and `masked_positions` [B,
  max_predictions] int32. Output: logits [B, max_predictions, vocab_size].
  Projecting only the masked positions keeps the vocabulary matmul small.

  Args:
    bert_config: a name from CONFIGS (tiny, mini, small, base) or a BertConfig.
    vocab_size: WordPiece vocabulary size.
    seq_len: tokens per sequence (<= max_positions).
    max_predictions: masked positions predicted per sequence.
    seed: seed of the initialisers and of dropout.

  Returns:
    An uncompiled `keras.Model`.
  """
  cfg = CONFIGS[bert_config] if isinstance(bert_config, str) else bert_config
  if seq_len > cfg.max_positions:
    raise ValueError(f"seq_len={seq_len} exceeds max_positions={cfg.max_positions}.")
  count = [0]

  def next_seed():
    count[0] += 1
    return seed * 1000 + count[0]

  def init():
    return keras.initializers.TruncatedNormal(stddev=0.02, seed=next_seed())

  ids = keras.Input((seq_len,), dtype="int32", name="input_ids")
  mask = keras.Input((seq_len,), dtype="int32", name="input_mask")
  positions = keras.Input((max_predictions,), dtype="int32", name="masked_positions")

  tokens = TiedEmbedding(vocab_size, cfg.hidden, seed=next_seed(), name="word_embeddings")
  x = tokens(ids)
  x = x + keras.layers.Embedding(cfg.max_positions, cfg.hidden, embeddings_initializer=init(),
                                 name="position_embeddings")(ops.arange(seq_len))
  x = x + keras.layers.Embedding(cfg.type_vocab_size, cfg.hidden, embeddings_initializer=init(),
                                 name="type_embeddings")(ops.zeros_like(ids))
  x = keras.layers.LayerNormalization(epsilon=1e-12, name="embeddings_norm")(x)
  x = keras.layers.Dropout(cfg.dropout, seed=next_seed())(x)
  attention_mask = ops.cast(ops.expand_dims(mask, 1), "bool")  # [B, 1, T]
  for i in range(cfg.layers):
    attn = keras.layers.MultiHeadAttention(
        cfg.heads, cfg.hidden // cfg.heads, dropout=cfg.dropout, seed=next_seed(),
        kernel_initializer=init(), name=f"layer{i}_attention")(
            x, x, attention_mask=attention_mask)
    attn = keras.layers.Dropout(cfg.dropout, seed=next_seed())(attn)
    x = keras.layers.LayerNormalization(epsilon=1e-12, name=f"layer{i}_attention_norm")(x + attn)
    h = keras.layers.Dense(cfg.intermediate, activation="gelu", kernel_initializer=init(),
                           name=f"layer{i}_intermediate")(x)
    h = keras.layers.Dense(cfg.hidden, kernel_initializer=init(), name=f"layer{i}_output")(h)
    h = keras.layers.Dropout(cfg.dropout, seed=next_seed())(h)
    x = keras.layers.LayerNormalization(epsilon=1e-12, name=f"layer{i}_output_norm")(x + h)

  # Gather the masked positions with a one-hot matmul: [B, K, T] @ [B, T, H].
  picked = ops.matmul(ops.one_hot(positions, seq_len, dtype=x.dtype), x)
  h = keras.layers.Dense(cfg.hidden, activation="gelu", kernel_initializer=init(),
                         name="mlm_transform")(picked)
  h = keras.layers.LayerNormalization(epsilon=1e-12, name="mlm_norm")(h)
  logits = tokens(h, mode="logits")
  return keras.Model({"input_ids": ids, "input_mask": mask, "masked_positions": positions},
                     logits, name=f"bert_{bert_config if isinstance(bert_config, str) else 'custom'}")
