"""Synthetic data with a learnable signal for every task, each example a pure function of (seed, index)."""

import numpy as np
import tensorflow as tf

import models
from tfdp import data
from tfdp import errors
from tfdp.datasets import text as text_data
from tfdp.datasets.dataset import Dataset
from tfdp.datasets.dataset import index_seed

SYNTHETIC_VOCAB_SIZE = 1024
SYNTHETIC_TOPICS = 8
SYNTHETIC_TOPIC_WORDS = 16
# Special ids of the synthetic vocabulary (the order of tfdp.datasets.tokenizer.SPECIAL).
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)


TRAIN = "train"
# The held-out split: examples num_examples, num_examples + 1, ... of the same
# generator (same templates, topics or preferences under the same seed), so
# no training example appears in it.
TEST = "test"
SPLITS = (TRAIN, TEST)


def held_out_examples(num_examples: int) -> int:
  """Size of the synthetic held-out split of a training split of `num_examples`."""
  return max(1, num_examples // 4)


def _check_split(split):
  if split not in SPLITS:
    raise errors.ConfigError(
        f"Synthetic data has the splits {list(SPLITS)} ({TEST!r}: a quarter as many "
        f"examples as --num_examples, none of them in {TRAIN!r}); got {split!r}.")


def for_task(task: str, *, num_examples: int, image_size: int, seq_len: int,
             max_predictions: int, seed: int, split: str = TRAIN) -> Dataset:
  """The synthetic Dataset of a model of `task` (models.IMAGE_CLASSIFICATION, ...).

  Args:
    task: the model's task.
    num_examples: examples of the training split.
    image_size: side of the images.
    seq_len: tokens per masked-LM sequence.
    max_predictions: masked positions per sequence.
    seed: the run's seed; it fixes the signal of every split.
    split: "train", or "test": `held_out_examples(num_examples)` examples
      drawn from the same distribution with indices past the training
      split's, so disjoint from it.

  Raises:
    ConfigError: no synthetic data for `task`, or an unknown split.
  """
  _check_split(split)
  if task == models.IMAGE_CLASSIFICATION:
    return synthetic_images(num_examples=num_examples, image_size=image_size, seed=seed,
                            split=split)
  if task == models.MASKED_LM:
    return synthetic_masked_lm(num_examples=num_examples, seq_len=seq_len,
                               max_predictions=max_predictions, seed=seed, split=split)
  if task == models.RECOMMENDATION:
    return synthetic_interactions(num_examples=num_examples, seed=seed, split=split)
  raise errors.ConfigError(f"No synthetic data for task {task!r}.")


def synthetic_images(*, num_examples: int = 2048, image_size: int = 32, num_classes: int = 10,
                     seed: int = 0, split: str = TRAIN) -> Dataset:
  """Per-class templates plus noise (tfdp.data.synthetic_images) at `image_size`.

  The "test" split takes examples [num_examples, num_examples + held out)
  of a generator over both splits: the same templates (they depend on the
  seed alone) and noise seeded by indices the training split never uses.
  """
  _check_split(split)
  shape = (image_size, image_size, 3)
  if split == TRAIN:
    source = data.synthetic_images(num_examples=num_examples, image_shape=shape,
                                   num_classes=num_classes, seed=seed)
  else:
    held_out = held_out_examples(num_examples)
    both = data.synthetic_images(num_examples=num_examples + held_out, image_shape=shape,
                                 num_classes=num_classes, seed=seed)
    source = data.FunctionSource(lambda indices: both.fn(indices + num_examples), held_out,
                                 name=f"{both.name}:test[{num_examples}:]")
  return Dataset(source, {"input_shape": shape, "num_classes": num_classes})


def synthetic_masked_lm(*, num_examples: int = 2048, seq_len: int = 128,
                        max_predictions: int | None = None,
                        vocab_size: int = SYNTHETIC_VOCAB_SIZE, seed: int = 0,
                        split: str = TRAIN) -> Dataset:
  """Token sequences with a learnable signal: each is drawn from one of a few topics.

  Sequence i picks a topic and a length in [seq_len/2, seq_len] from (seed,
  i); its tokens are uniform over that topic's 16 words. A masked token is
  thus predictable from the rest of the sequence (loss falls from
  ln(vocab_size) towards ln(16)). The "test" split holds sequences
  num_examples, num_examples + 1, ... of the same topics.

  Raises:
    ConfigError: seq_len below 8, or an unknown split.
  """
  _check_split(split)
  if seq_len < 8:
    raise errors.ConfigError(f"--seq_len must be >= 8, got {seq_len}.")
  max_predictions = text_data.default_max_predictions(seq_len, max_predictions)
  topics = np.random.default_rng(seed).choice(
      np.arange(5, vocab_size), size=(SYNTHETIC_TOPICS, SYNTHETIC_TOPIC_WORDS),
      replace=False).astype(np.int32)

  offset, size = (0, num_examples) if split == TRAIN else (
      num_examples, held_out_examples(num_examples))

  def fn(indices):
    indices = indices + offset

    def one(index):
      s = index_seed(seed, index, 1)
      topic = tf.random.stateless_uniform([], s, 0, SYNTHETIC_TOPICS, tf.int32)
      length = tf.random.stateless_uniform([], s + [0, 1], seq_len // 2, seq_len + 1, tf.int32)
      words = tf.random.stateless_uniform([seq_len], s + [0, 2], 0, SYNTHETIC_TOPIC_WORDS, tf.int32)
      ids = tf.gather(tf.constant(topics)[topic], words)
      pos = tf.range(seq_len)
      ids = tf.where(pos == 0, CLS_ID, tf.where(pos == length - 1, SEP_ID,
                                                tf.where(pos >= length, PAD_ID, ids)))
      return ids, tf.cast(pos < length, tf.int32)

    ids, mask = tf.map_fn(one, indices, fn_output_signature=(tf.int32, tf.int32))
    return {"input_ids": ids, "input_mask": mask, "index": indices}

  name = f"synthetic_masked_lm:{num_examples}:{seq_len}:{vocab_size}:{seed}"
  if split != TRAIN:
    name += f":test[{num_examples}:]"
  return text_data.masked_lm_dataset(
      data.FunctionSource(fn, size, name=name), vocab_size=vocab_size,
      special_ids=(PAD_ID, CLS_ID, SEP_ID), mask_id=MASK_ID, seq_len=seq_len,
      max_predictions=max_predictions, seed=seed)


def synthetic_interactions(*, num_examples: int = 8192, num_users: int = 1000,
                           num_items: int = 1000, num_dense: int = 8, latent: int = 4,
                           seed: int = 0, split: str = TRAIN) -> Dataset:
  """(user, item, dense features) -> like/not, from a low-rank preference model plus noise.

  label = [u_user . v_item + w . dense + noise > 0], so the embeddings and
  the dense features both carry signal. The "test" split holds new
  interactions of the same users and items (same preferences): its own
  (user, item) draws and dense features and noise seeded by indices past
  the training split's.
  """
  _check_split(split)
  rng = np.random.default_rng(seed)
  users = rng.normal(size=(num_users, latent)).astype(np.float32)
  items = rng.normal(size=(num_items, latent)).astype(np.float32)
  w = (rng.normal(size=(num_dense,)) / np.sqrt(num_dense)).astype(np.float32)

  # The training split keeps its draws (salts 0, 1); the held-out one has its own.
  offset, size, salt = (0, num_examples, 0) if split == TRAIN else (
      num_examples, held_out_examples(num_examples), 2)

  def fn(indices):
    s = tf.stack([tf.constant(seed, tf.int64), tf.constant(11, tf.int64)])
    user = tf.cast(tf.random.experimental.index_shuffle(indices, s + [0, salt], size - 1)
                   % num_users, tf.int32)
    item = tf.cast(tf.random.experimental.index_shuffle(indices, s + [0, salt + 1], size - 1)
                   % num_items, tf.int32)

    def one(index):
      k = index_seed(seed, index + offset, 3)
      return (tf.random.stateless_normal([num_dense], k),
              tf.random.stateless_normal([], k + [0, 1]))

    dense, noise = tf.map_fn(one, indices, fn_output_signature=(tf.float32, tf.float32))
    score = (tf.reduce_sum(tf.gather(users, user) * tf.gather(items, item), -1)
             + tf.linalg.matvec(dense, tf.constant(w)) + 0.3 * noise)
    return {"dense": dense, "user": user, "item": item}, tf.cast(score > 0, tf.float32)

  name = f"synthetic_interactions:{num_examples}:{num_users}:{num_items}:{num_dense}:{seed}"
  if split != TRAIN:
    name += f":test[{num_examples}:]"
  return Dataset(data.FunctionSource(fn, size, name=name),
                 {"vocab_sizes": {"user": num_users, "item": num_items}, "num_dense": num_dense})
