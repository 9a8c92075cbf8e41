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
# Special ids of the synthetic vocabulary (the order of tfdp.text.SPECIAL).
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)


def for_task(task: str, *, num_examples: int, image_size: int, seq_len: int,
             max_predictions: int, seed: int) -> Dataset:
  """The synthetic Dataset of a model of `task` (models.IMAGE_CLASSIFICATION, ...).

  Raises:
    ConfigError: no synthetic data for `task`.
  """
  if task == models.IMAGE_CLASSIFICATION:
    return synthetic_images(num_examples=num_examples, image_size=image_size, seed=seed)
  if task == models.MASKED_LM:
    return synthetic_masked_lm(num_examples=num_examples, seq_len=seq_len,
                               max_predictions=max_predictions, seed=seed)
  if task == models.RECOMMENDATION:
    return synthetic_interactions(num_examples=num_examples, seed=seed)
  raise errors.ConfigError(f"No synthetic data for task {task!r}.")


def synthetic_images(*, num_examples: int = 2048, image_size: int = 32, num_classes: int = 10,
                     seed: int = 0) -> Dataset:
  """Per-class templates plus noise (tfdp.data.synthetic_images) at `image_size`."""
  shape = (image_size, image_size, 3)
  source = data.synthetic_images(num_examples=num_examples, image_shape=shape,
                                 num_classes=num_classes, seed=seed)
  return Dataset(source, {"input_shape": shape, "num_classes": num_classes})


def synthetic_masked_lm(*, num_examples: int = 2048, seq_len: int = 128,
                        max_predictions: int | None = None,
                        vocab_size: int = SYNTHETIC_VOCAB_SIZE, seed: int = 0) -> Dataset:
  """Token sequences with a learnable signal: each is drawn from one of a few topics.

  Sequence i picks a topic and a length in [seq_len/2, seq_len] from (seed,
  i); its tokens are uniform over that topic's 16 words. A masked token is
  thus predictable from the rest of the sequence (loss falls from
  ln(vocab_size) towards ln(16)).

  Raises:
    ConfigError: seq_len below 8.
  """
  if seq_len < 8:
    raise errors.ConfigError(f"--seq_len must be >= 8, got {seq_len}.")
  max_predictions = text_data.default_max_predictions(seq_len, max_predictions)
  topics = np.random.default_rng(seed).choice(
      np.arange(5, vocab_size), size=(SYNTHETIC_TOPICS, SYNTHETIC_TOPIC_WORDS),
      replace=False).astype(np.int32)

  def fn(indices):
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
  return text_data.masked_lm_dataset(
      data.FunctionSource(fn, num_examples, name=name), vocab_size=vocab_size,
      special_ids=(PAD_ID, CLS_ID, SEP_ID), mask_id=MASK_ID, seq_len=seq_len,
      max_predictions=max_predictions, seed=seed)


def synthetic_interactions(*, num_examples: int = 8192, num_users: int = 1000,
                           num_items: int = 1000, num_dense: int = 8, latent: int = 4,
                           seed: int = 0) -> Dataset:
  """(user, item, dense features) -> like/not, from a low-rank preference model plus noise.

  label = [u_user . v_item + w . dense + noise > 0], so the embeddings and
  the dense features both carry signal.
  """
  rng = np.random.default_rng(seed)
  users = rng.normal(size=(num_users, latent)).astype(np.float32)
  items = rng.normal(size=(num_items, latent)).astype(np.float32)
  w = (rng.normal(size=(num_dense,)) / np.sqrt(num_dense)).astype(np.float32)

  def fn(indices):
    s = tf.stack([tf.constant(seed, tf.int64), tf.constant(11, tf.int64)])
    user = tf.cast(tf.random.experimental.index_shuffle(indices, s, num_examples - 1)
                   % num_users, tf.int32)
    item = tf.cast(tf.random.experimental.index_shuffle(indices, s + [0, 1], num_examples - 1)
                   % num_items, tf.int32)

    def one(index):
      k = index_seed(seed, index, 3)
      return (tf.random.stateless_normal([num_dense], k),
              tf.random.stateless_normal([], k + [0, 1]))

    dense, noise = tf.map_fn(one, indices, fn_output_signature=(tf.float32, tf.float32))
    score = (tf.reduce_sum(tf.gather(users, user) * tf.gather(items, item), -1)
             + tf.linalg.matvec(dense, tf.constant(w)) + 0.3 * noise)
    return {"dense": dense, "user": user, "item": item}, tf.cast(score > 0, tf.float32)

  name = f"synthetic_interactions:{num_examples}:{num_users}:{num_items}:{num_dense}:{seed}"
  return Dataset(data.FunctionSource(fn, num_examples, name=name),
                 {"vocab_sizes": {"user": num_users, "item": num_items}, "num_dense": num_dense})
