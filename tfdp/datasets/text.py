"""Masked-LM data: BERT's masking as a transform, and local text corpora tokenised with WordPiece."""

import re

import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp import errors
from tfdp.datasets import tokenizer as text
from tfdp.datasets.dataset import Dataset
from tfdp.datasets.dataset import index_seed

MASK_RATE = 0.15
# A text corpus has no split of its own; its held-out split "test" is the
# last HELD_OUT_PERCENT% of its lines, and a run that evaluates on it trains
# on the rest (TFDS's slicing syntax names both).
HELD_OUT_PERCENT = 10
_SLICE = re.compile(r"^train\[(:)?(\d{1,2})%(:)?\]$")


def corpus_split(split: str) -> tuple[int, int]:
  """The [first, last) percent of a corpus's lines `split` names.

  "train" is every line; "train[:P%]" the first P%; "train[P%:]" the rest;
  "test" is "train[90%:]" (HELD_OUT_PERCENT).

  Raises:
    ConfigError: any other name.
  """
  if split == "train":
    return 0, 100
  if split == "test":
    return 100 - HELD_OUT_PERCENT, 100
  m = _SLICE.match(split)
  if m and bool(m.group(1)) != bool(m.group(3)) and 0 < int(m.group(2)) < 100:
    p = int(m.group(2))
    return (0, p) if m.group(1) else (p, 100)
  raise errors.ConfigError(
      f"A text corpus has the splits train (every line), test (the last "
      f"{HELD_OUT_PERCENT}% of its lines), train[:P%] and train[P%:]; got {split!r}.")


def training_split(eval_split: str | None) -> str:
  """The split a run trains on when it evaluates on `eval_split` (None: no evaluation)."""
  if eval_split is None:
    return "train"
  first, last = corpus_split(eval_split)
  if last == 100 and first > 0:
    return f"train[:{first}%]"
  if first == 0 and last < 100:
    return f"train[{last}%:]"
  return "train"


def default_max_predictions(seq_len: int, max_predictions: int | None = None) -> int:
  """`max_predictions`, or by default MASK_RATE of `seq_len` (at least 1)."""
  return max_predictions or max(1, int(round(seq_len * MASK_RATE)))


def masked_lm_transform(*, seed: int, vocab_size: int, max_predictions: int,
                        special_ids: tuple, mask_id: int,
                        rate: float = MASK_RATE) -> data.Transform:
  """BERT's masking as `fn(batch, step) -> (inputs, masked_ids, weights)`.

  In each sequence, round(rate * n) of its n non-special tokens (at least 1,
  at most max_predictions) are chosen; of those, 80% become [MASK], 10% a
  random token and 10% stay. The choice for example i at step k is a pure
  function of (seed, k, i): resumption sees the same masks, the same
  example gets new masks in each epoch (dynamic masking), and the masks do
  not depend on how the batch is split over replicas.

  `batch` is a dict with `input_ids`, `input_mask` [B, T] and `index` [B].
  """
  def one(args, step):
    ids, index = args
    key = tf.random.experimental.stateless_fold_in(index_seed(seed, step, 7), index)
    k1, k2, k3 = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    candidate = tf.reduce_all(tf.stack([ids != s for s in special_ids]), axis=0)
    n = tf.reduce_sum(tf.cast(candidate, tf.int32))
    k = tf.clip_by_value(tf.cast(tf.round(rate * tf.cast(n, tf.float32)), tf.int32),
                         1, max_predictions)
    scores = tf.where(candidate, tf.random.stateless_uniform(tf.shape(ids), k1), -1.0)
    positions = tf.math.top_k(scores, max_predictions).indices
    weights = tf.range(max_predictions) < tf.minimum(k, n)
    original = tf.gather(ids, positions)
    u = tf.random.stateless_uniform([max_predictions], k2)
    random_ids = tf.random.stateless_uniform([max_predictions], k3, 0, vocab_size, tf.int32)
    replaced = tf.where(u < 0.8, mask_id, tf.where(u < 0.9, random_ids, original))
    replaced = tf.where(weights, replaced, original)
    new_ids = tf.tensor_scatter_nd_update(ids, positions[:, None], replaced)
    return new_ids, positions, original, tf.cast(weights, tf.float32)

  def transform(batch, step):
    new_ids, positions, labels, weights = tf.map_fn(
        lambda a: one(a, step), (batch["input_ids"], batch["index"]),
        fn_output_signature=(tf.int32, tf.int32, tf.int32, tf.float32))
    inputs = {"input_ids": new_ids, "input_mask": batch["input_mask"],
              "masked_positions": positions}
    return inputs, labels, weights

  return transform


def masked_lm_dataset(source: data.Source, *, vocab_size: int, special_ids: tuple,
                      mask_id: int, seq_len: int, max_predictions: int, seed: int) -> Dataset:
  """The masked-LM Dataset of token sequences `source` (dicts of input_ids, input_mask, index)."""
  return Dataset(
      source,
      {"vocab_size": vocab_size, "seq_len": seq_len, "max_predictions": max_predictions},
      transform=masked_lm_transform(seed=seed, vocab_size=vocab_size,
                                    max_predictions=max_predictions,
                                    special_ids=special_ids, mask_id=mask_id))


def wordpiece_dataset(source: data.Source, tokenizer: text.WordPiece, *, seq_len: int,
                      max_predictions: int, seed: int) -> Dataset:
  """`masked_lm_dataset` of sequences encoded by `tokenizer`, masked with its special ids."""
  return masked_lm_dataset(
      source, vocab_size=tokenizer.vocab_size,
      special_ids=(tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id),
      mask_id=tokenizer.mask_id, seq_len=seq_len, max_predictions=max_predictions, seed=seed)


def text_corpus(path: str, *, vocab_file: str | None, seq_len: int = 128,
                max_predictions: int = 20, seed: int = 0, split: str = "train") -> Dataset:
  """A local text file, one example per non-empty line, tokenised once at start-up.

  Args:
    path: the corpus.
    vocab_file: its WordPiece vocabulary.
    seq_len: tokens per sequence.
    max_predictions: masked positions per sequence.
    seed: seed of the masks.
    split: "train" (every line), "test" (the last HELD_OUT_PERCENT% of the
      non-empty lines), "train[:P%]" or "train[P%:]" (see `corpus_split`).

  Raises:
    ConfigError: the vocabulary or the corpus is missing, the corpus is
      empty, or the split is unknown or empty.
  """
  first, last = corpus_split(split)
  tokenizer = text.WordPiece(vocab_file)
  if not tf.io.gfile.exists(path):
    raise errors.ConfigError(f"Text corpus {path!r} not found (--dataset=text:PATH).")
  with tf.io.gfile.GFile(path, "r") as f:
    lines = [l.strip() for l in f if l.strip()]
  if not lines:
    raise errors.ConfigError(f"Text corpus {path} has no non-empty lines.")
  total = len(lines)
  start = total * first // 100
  lines = lines[start:total * last // 100]
  if not lines:
    raise errors.ConfigError(
        f"Split {split!r} of text corpus {path} ({total} lines) is empty; use a larger corpus.")
  encoded = [tokenizer.encode(l, seq_len) for l in lines]
  arrays = {"input_ids": np.stack([e[0] for e in encoded]),
            "input_mask": np.stack([e[1] for e in encoded]),
            "index": np.arange(start, start + len(lines), dtype=np.int64)}
  name = f"text:{path}:{seq_len}" + ("" if split == "train" else f":{split}")
  return wordpiece_dataset(data.ArraySource(arrays, name=name), tokenizer, seq_len=seq_len,
                           max_predictions=max_predictions, seed=seed)
