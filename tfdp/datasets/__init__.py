"""`--dataset` names -> Datasets for every model: synthetic, TFDS (random access or sequential) and local text.

Every dataset is position-addressable: the batch of global step k is a pure
function of (seed, k), so a resumed run sees exactly the batches it would
have seen. Random choices made per batch (the masked-LM masks) are derived
from (seed, step, example index) in a `transform`, never from a stateful RNG.
The models they feed come from the `models` package beside tfdp.

Owns:
- dataset.py: the Dataset record every kind returns, per-example seeds;
- synthetic.py: synthetic data with a learnable signal for every task;
- tfds.py: prepared TFDS datasets, by random access or in file order;
- text.py: masked-LM masking and local text corpora;
- tokenizer.py: the WordPiece tokenizer;
- interactions.py: recommendation data sharded by file per worker.
May import: tfdp.data, tfdp.errors.
"""

import models
from tfdp import errors
from tfdp.datasets import synthetic as _synthetic
from tfdp.datasets import text as _text
from tfdp.datasets import tfds as _tfds
# The public names, importable from here as before the split.
from tfdp.datasets.dataset import Dataset
from tfdp.datasets.interactions import FileShardedSource, worker_files_error, worker_indices
from tfdp.datasets.synthetic import (
    CLS_ID, MASK_ID, PAD_ID, SEP_ID, SYNTHETIC_TOPIC_WORDS, SYNTHETIC_TOPICS,
    SYNTHETIC_VOCAB_SIZE, UNK_ID, synthetic_images, synthetic_interactions,
    synthetic_masked_lm)
from tfdp.datasets.text import MASK_RATE, masked_lm_transform, text_corpus
from tfdp.datasets.tfds import IMAGE_MEAN, IMAGE_STD, tfds_builder, tfds_dataset

SYNTHETIC = "synthetic"
TFDS_PREFIX = "tfds:"
TEXT_PREFIX = "text:"

__all__ = [
    "CLS_ID", "Dataset", "FileShardedSource", "IMAGE_MEAN", "IMAGE_STD", "MASK_ID",
    "MASK_RATE", "PAD_ID", "SEP_ID", "SYNTHETIC", "SYNTHETIC_TOPICS",
    "SYNTHETIC_TOPIC_WORDS", "SYNTHETIC_VOCAB_SIZE", "TEXT_PREFIX", "TFDS_PREFIX", "UNK_ID",
    "check_name", "eval_split", "load", "training_split", "masked_lm_transform", "synthetic_images",
    "synthetic_interactions", "synthetic_masked_lm", "text_corpus", "tfds_builder",
    "tfds_dataset", "worker_files_error", "worker_indices",
]


def load(name: str, *, task: str, seed: int = 0, num_examples: int = 2048,
         image_size: int | None = None, data_dir: str | None = None,
         vocab_file: str | None = None, seq_len: int = 128,
         max_predictions: int | None = None, num_workers: int = 1,
         split: str = "train") -> Dataset:
  """The Dataset `name` for a model of `task`.

  Args:
    name: `synthetic`, `tfds:NAME[:CONFIG]` or `text:PATH` (a local corpus,
      one example per line; masked LM only).
    task: models.IMAGE_CLASSIFICATION, MASKED_LM or RECOMMENDATION.
    seed: seed of synthetic data and of the masks.
    num_examples: size of synthetic datasets.
    image_size: side of the images fed to the model (None: the dataset's own,
      else 32).
    data_dir: TFDS data directory (None: TFDS's default).
    vocab_file: WordPiece vocabulary for text datasets.
    seq_len: tokens per masked-LM sequence.
    max_predictions: masked positions per sequence (default: 15% of seq_len).
    num_workers: workers of the job (recorded for file-sharded data).
    split: "train", or a held-out split (see `eval_split`): synthetic data
      has "test" (examples disjoint from "train"); a TFDS dataset has the
      splits it was prepared with; a text corpus has "test" (its last 10% of
      lines), "train[:P%]" and "train[P%:]".

  Returns:
    A Dataset.

  Raises:
    ConfigError: unknown name, a dataset that is not prepared, or features
      the model cannot use; the message says what to do.
  """
  max_predictions = _text.default_max_predictions(seq_len, max_predictions)
  if name == SYNTHETIC:
    return _synthetic.for_task(task, num_examples=num_examples, image_size=image_size or 32,
                               seq_len=seq_len, max_predictions=max_predictions, seed=seed,
                               split=split)
  if name.startswith(TEXT_PREFIX):
    if task != models.MASKED_LM:
      raise errors.ConfigError(f"--dataset={name} is a text corpus; it feeds --model=bert only.")
    return _text.text_corpus(name[len(TEXT_PREFIX):], vocab_file=vocab_file, seq_len=seq_len,
                             max_predictions=max_predictions, seed=seed, split=split)
  if name.startswith(TFDS_PREFIX):
    return _tfds.tfds_dataset(name[len(TFDS_PREFIX):], task=task, data_dir=data_dir,
                              split=split, image_size=image_size, vocab_file=vocab_file,
                              seq_len=seq_len, max_predictions=max_predictions, seed=seed,
                              num_workers=num_workers)
  raise errors.ConfigError(_unknown(name))


def eval_split(name: str, split: str | None = None, *, data_dir: str | None = None) -> str:
  """The split to evaluate on: `split`, or by default the held-out split of dataset `name`.

  The default is "test" for synthetic data and text corpora, and for a TFDS
  dataset its "test" split, else its "validation" split.

  Raises:
    ConfigError: a TFDS dataset with neither, or `split` is the training
      split of a text corpus (it would evaluate on the training data).
  """
  if name.startswith(TFDS_PREFIX):
    return split or _tfds.held_out_split(name[len(TFDS_PREFIX):], data_dir)
  if name.startswith(TEXT_PREFIX) and split is not None:
    if _text.training_split(split) == "train":
      raise errors.ConfigError(
          f"--eval_split={split} holds every line of {name}; evaluate on test or "
          "train[P%:] (training then uses the other lines).")
  return split or _synthetic.TEST


def training_split(name: str, eval_split: str | None = None) -> str:
  """The split a run trains on when it evaluates on `eval_split` (None: no evaluation).

  "train", except for a text corpus evaluated on a slice of its lines: then
  the other lines (e.g. "train[:90%]" beside "test").
  """
  if name.startswith(TEXT_PREFIX):
    return _text.training_split(eval_split)
  return "train"


def check_name(name: str) -> None:
  """Raises ConfigError if `name` is not a dataset name `load` understands."""
  if not (name == SYNTHETIC or name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX)
          or name.startswith(TEXT_PREFIX) and len(name) > len(TEXT_PREFIX)):
    raise errors.ConfigError(_unknown(name))


def _unknown(name):
  return (f"Unknown --dataset {name!r}; use synthetic, tfds:NAME[:CONFIG] (with "
          "--data_dir) or text:PATH (with --vocab_file).")
