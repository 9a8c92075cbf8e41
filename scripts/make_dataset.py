"""Writes small but real TFDS datasets (images, text corpus + WordPiece vocab, interaction shards) to local disk."""

import os
import sys

from absl import app
from absl import flags
from absl import logging
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = flags.FLAGS
MODALITIES = ("images", "text", "interactions")


IMAGES, TEXT, INTERACTIONS = "tfdp_images", "tfdp_text", "tfdp_interactions"
NUM_USERS, NUM_ITEMS, NUM_DENSE = 200, 100, 4

_TOPICS = {
    "weather": "rain snow wind cloud storm sunny cold warm thunder forecast",
    "cooking": "bread butter flour oven recipe salt pepper onion garlic soup",
    "sailing": "boat sail harbour wave anchor mast keel tide compass crew",
    "music": "piano violin melody rhythm chord guitar concert singer drum tune",
    "space": "planet orbit rocket comet galaxy star moon telescope asteroid launch",
    "garden": "tomato seed soil flower weed hose shovel tulip rose compost",
}
_GLUE = "the a of and to in on with is was for it this that by at".split()


def image_arrays(n: int, size: int, num_classes: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
  """uint8 images: a per-class colour pattern plus noise; labels."""
  rng = np.random.default_rng(seed)
  templates = rng.uniform(40, 215, size=(num_classes, 4, 4, 3))
  labels = rng.integers(0, num_classes, size=n)
  reps = size // 4 + 1
  big = np.repeat(np.repeat(templates, reps, axis=1), reps, axis=2)[:, :size, :size]
  images = big[labels] + rng.normal(0, 25, size=(n, size, size, 3))
  return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)


def corpus(n: int, seed: int) -> list[str]:
  """n short documents, each mostly about one topic."""
  rng = np.random.default_rng(seed)
  topics = list(_TOPICS.values())
  docs = []
  for _ in range(n):
    words = topics[rng.integers(len(topics))].split()
    length = rng.integers(12, 40)
    doc = [str(rng.choice(words)) if rng.random() < 0.7 else str(rng.choice(_GLUE))
           for _ in range(length)]
    docs.append(" ".join(doc).capitalize() + ".")
  return docs


def interaction_arrays(n: int, seed: int) -> dict[str, np.ndarray]:
  """(id, user, item, label, dense): label from a low-rank preference model plus noise."""
  rng = np.random.default_rng(seed)
  u = rng.normal(size=(NUM_USERS, 3))
  v = rng.normal(size=(NUM_ITEMS, 3))
  w = rng.normal(size=NUM_DENSE)
  users = rng.integers(0, NUM_USERS, size=n)
  items = rng.integers(0, NUM_ITEMS, size=n)
  dense = rng.normal(size=(n, NUM_DENSE)).astype(np.float32)
  score = (u[users] * v[items]).sum(-1) + dense @ w + 0.3 * rng.normal(size=n)
  return {"id": np.arange(n, dtype=np.int64), "user": users.astype(np.int64),
          "item": items.astype(np.int64), "label": (score > 0).astype(np.int64),
          "dense": dense}


def _store(name, features, arrays, data_dir, file_format, num_shards=None):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  ds = tf.data.Dataset.from_tensor_slices(arrays)
  builder = tfds.dataset_builders.store_as_tfds_dataset(
      name=name, version="1.0.0", features=features, split_datasets={"train": ds},
      data_dir=data_dir, file_format=file_format, disable_shuffling=True,
      description="Written by tfdp scripts/make_dataset.py.",
      download_config=tfds.download.DownloadConfig(num_shards=num_shards))
  logging.info("Wrote %s: %d examples in %s", name,
               builder.info.splits["train"].num_examples, builder.data_dir)
  return builder


def write_images(data_dir: str, *, num_examples: int = 512, image_size: int = 32,
                 num_classes: int = 10, seed: int = 0, file_format: str = "array_record"):
  """The TFDS image dataset: uint8 images of `image_arrays` and class labels.

  Returns:
    The dataset's TFDS builder.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  images, labels = image_arrays(num_examples, image_size, num_classes, seed)
  features = tfds.features.FeaturesDict({
      "image": tfds.features.Image(shape=(image_size, image_size, 3)),
      "label": tfds.features.ClassLabel(num_classes=num_classes)})
  return _store(IMAGES, features, {"image": images, "label": labels}, data_dir, file_format)


def write_text(data_dir: str, *, num_examples: int = 512, vocab_size: int = 400, seed: int = 0,
               file_format: str = "array_record"):
  """The TFDS text dataset, plus `tfdp_text_corpus/{corpus.txt,vocab.txt}` beside it.

  Returns:
    The dataset's TFDS builder.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tfdp.datasets import tokenizer as text  # pylint: disable=g-import-not-at-top
  docs = corpus(num_examples, seed)
  raw = os.path.join(data_dir, "tfdp_text_corpus")
  os.makedirs(raw, exist_ok=True)
  with open(os.path.join(raw, "corpus.txt"), "w") as f:
    f.write("\n".join(docs) + "\n")
  with open(os.path.join(raw, "vocab.txt"), "w") as f:
    f.write("\n".join(text.build_vocab(docs, vocab_size)) + "\n")
  features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
  return _store(TEXT, features, {"text": np.array(docs, dtype=object)}, data_dir, file_format)


def write_interactions(data_dir: str, *, num_examples: int = 512, num_shards: int = 4,
                       seed: int = 0, file_format: str = "array_record"):
  """The TFDS interactions dataset in `num_shards` files (workers read whole files).

  Returns:
    The dataset's TFDS builder.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  features = tfds.features.FeaturesDict({
      "id": tf.int64,
      "user": tfds.features.ClassLabel(num_classes=NUM_USERS),
      "item": tfds.features.ClassLabel(num_classes=NUM_ITEMS),
      "label": tfds.features.ClassLabel(num_classes=2),
      "dense": tfds.features.Tensor(shape=(NUM_DENSE,), dtype=tf.float32)})
  return _store(INTERACTIONS, features, interaction_arrays(num_examples, seed), data_dir,
                file_format, num_shards=num_shards)


def define_flags() -> None:
  """Defines the script's flags; only when run as a script, so that importing
  its writers (as the tests do) leaves the global flag registry alone."""
  flags.DEFINE_string("data_dir", None, "TFDS data directory to write into.", required=True)
  flags.DEFINE_list("modality", list(MODALITIES), f"Which of {', '.join(MODALITIES)} to write.")
  flags.DEFINE_integer("num_examples", 512, "Examples in the train split.", lower_bound=1)
  flags.DEFINE_integer("image_size", 32, "Side of the images.", lower_bound=8)
  flags.DEFINE_integer("num_classes", 10, "Image classes.", lower_bound=2)
  flags.DEFINE_integer("num_shards", 4, "Files of the interactions split (workers read whole files).",
                       lower_bound=1)
  flags.DEFINE_integer("vocab_size", 400, "Size of the WordPiece vocabulary written.", lower_bound=64)
  flags.DEFINE_enum("file_format", "array_record", ["array_record", "tfrecord"],
                    "array_record gives random access (O(1) resume); tfrecord exercises "
                    "the sequential fallback.")
  flags.DEFINE_integer("seed", 0, "Seed of the generated data.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  unknown = set(FLAGS.modality) - set(MODALITIES)
  if unknown:
    raise app.UsageError(f"Unknown --modality {sorted(unknown)}; use {', '.join(MODALITIES)}.")
  kw = dict(num_examples=FLAGS.num_examples, seed=FLAGS.seed, file_format=FLAGS.file_format)
  if "images" in FLAGS.modality:
    write_images(FLAGS.data_dir, image_size=FLAGS.image_size, num_classes=FLAGS.num_classes, **kw)
  if "text" in FLAGS.modality:
    write_text(FLAGS.data_dir, vocab_size=FLAGS.vocab_size, **kw)
  if "interactions" in FLAGS.modality:
    write_interactions(FLAGS.data_dir, num_shards=FLAGS.num_shards, **kw)
  print(f"Datasets in {FLAGS.data_dir}: --dataset=tfds:{IMAGES} | tfds:{TEXT} "
        f"(--vocab_file={os.path.join(FLAGS.data_dir, 'tfdp_text_corpus', 'vocab.txt')}) | "
        f"tfds:{INTERACTIONS}, each with --data_dir={FLAGS.data_dir}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
