"""Prepared TFDS datasets, read from local disk: random access where the file format allows it, else in file order.

Datasets in ArrayRecord (or Parquet) files are read with
`builder.as_data_source` (random access: resuming at step k costs O(1)).
Datasets prepared in the TFRecord format have no random access; they are
read in file order with `builder.as_dataset` and resuming skips
k * global_batch_size examples (O(k), unshuffled). Recommendation datasets
are sharded by file per worker (tfdp.datasets.interactions). Nothing here
downloads: an unprepared dataset is a ConfigError that says how to prepare
it offline.
"""

import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

import models
from tfdp import data
from tfdp import errors
from tfdp.datasets import tokenizer as text
from tfdp.datasets import interactions
from tfdp.datasets import text as text_data
from tfdp.datasets.dataset import Dataset

IMAGE_MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
IMAGE_STD = np.array([0.229, 0.224, 0.225], np.float32) * 255

# The features a model of each task reads.
_NEEDS = {models.IMAGE_CLASSIFICATION: ("image", "label"), models.MASKED_LM: ("text",),
          models.RECOMMENDATION: ("user", "item", "label", "dense")}


def _prepare_hint(full_name, data_dir):
  where = data_dir or "~/tensorflow_datasets"
  return (
      f"Prepare it on a machine with network access with `tfds build {full_name.split(':')[0]} "
      f"--data_dir={where} --file_format=array_record` and copy the directory over, or, "
      "for datasets whose files must be fetched by hand (e.g. imagenet2012), put them in "
      f"a manual dir and run `tfds.builder({full_name!r}, data_dir={where!r})"
      ".download_and_prepare(download_config=tfds.download.DownloadConfig("
      "manual_dir=...), file_format='array_record')`. Datasets written by "
      "scripts/make_dataset.py need no preparation. tfdp never downloads.")


def tfds_builder(spec: str, data_dir: str | None = None) -> Any:
  """The prepared TFDS builder of `NAME[:CONFIG]`.

  Raises:
    ConfigError: the dataset is unknown or not prepared in `data_dir`.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name, _, config = spec.partition(":")
  full = f"{name}/{config}" if config else name
  try:
    # try_gcs=False (the default) keeps TFDS off the network; so does never
    # calling download_and_prepare here.
    builder = tfds.builder(full, data_dir=data_dir, try_gcs=False)
  except tfds.core.registered.DatasetNotFoundError:
    raise errors.ConfigError(
        f"TFDS dataset {full!r} is neither a TFDS catalogue name nor prepared in "
        f"--data_dir={data_dir}. " + _prepare_hint(full, data_dir)) from None
  except Exception as e:  # pylint: disable=broad-except
    raise errors.ConfigError(
        f"TFDS dataset {full!r} cannot be opened from --data_dir={data_dir} ({e}). "
        + _prepare_hint(full, data_dir)) from None
  if not builder.is_prepared():
    raise errors.ConfigError(
        f"TFDS dataset {full!r} is not prepared in {builder.data_dir}. "
        + _prepare_hint(full, data_dir))
  return builder


HELD_OUT_SPLITS = ("test", "validation")


def held_out_split(spec: str, data_dir: str | None = None) -> str:
  """The split of `NAME[:CONFIG]` to evaluate on: "test", else "validation".

  Raises:
    ConfigError: the dataset is not prepared, or has neither split.
  """
  splits = tfds_builder(spec, data_dir).info.splits
  for split in HELD_OUT_SPLITS:
    if split in splits:
      return split
  raise errors.ConfigError(
      f"TFDS dataset {spec!r} has no test or validation split (it has "
      f"{sorted(splits)}); pass --eval_split=SPLIT, one not used for training.")


def _random_access(builder):
  from tensorflow_datasets.core import file_adapters  # pylint: disable=g-import-not-at-top
  fmt = builder.info.file_format
  return fmt is not None and file_adapters.FileFormat(fmt) in (
      file_adapters.FileFormat.ARRAY_RECORD,) + tuple(
          getattr(file_adapters.FileFormat, n) for n in ("PARQUET",)
          if hasattr(file_adapters.FileFormat, n))


@dataclasses.dataclass(frozen=True)
class _Decoder:
  """How TFDS examples become a batch.

  `convert(list of example dicts) -> tuple of numpy arrays` runs in Python
  (tf.numpy_function); `dtypes`/`shapes` describe its outputs (without the
  batch axis) and `pack(indices, *outputs)` turns them into the batch
  structure.
  """
  convert: Callable
  dtypes: tuple
  shapes: tuple
  pack: Callable


class TfdsSource(data.RandomAccessSource):
  """Random access to a TFDS split through `as_data_source`, decoded by a `_Decoder`.

  Example i is example `index_map[i]` of the split (all of it by default).
  """

  def __init__(self, data_source: Any, decoder: _Decoder, name: str,
               index_map: np.ndarray | None = None):
    self._ds = data_source
    self._decoder = decoder
    self._index_map = index_map
    self.name = name
    self.num_examples = len(index_map) if index_map is not None else len(data_source)

  def _read(self, indices):
    if self._index_map is not None:
      indices = self._index_map[indices]
    # One by one, not `__getitems__`: ArrayRecord's batched read submits to a
    # thread pool, which fails (and can hang the process) when tf.data's
    # prefetch calls it during interpreter shutdown.
    examples = [self._ds[int(i)] for i in indices]
    return tuple(np.asarray(a, d)
                 for a, d in zip(self._decoder.convert(examples), self._decoder.dtypes))

  def fetch(self, indices: tf.Tensor) -> Any:
    d = self._decoder
    outs = tf.numpy_function(self._read, [indices], list(d.dtypes), stateful=False)
    outs = [tf.ensure_shape(o, (None,) + tuple(s)) for o, s in zip(outs, d.shapes)]
    return d.pack(indices, *outs)


def _sequential_source(builder, split, decoder, name, num_examples):
  """Fallback for TFRecord-format datasets: file order, resume by skipping (O(k))."""
  keys = sorted(builder.info.features.keys())

  def one(example):
    def py(*flat):
      ex = dict(zip(keys, flat))
      return tuple(np.asarray(a[0], d) for a, d in zip(decoder.convert([ex]), decoder.dtypes))
    outs = tf.numpy_function(py, [example[k] for k in keys], list(decoder.dtypes),
                             stateful=False)
    return [tf.ensure_shape(o, s) for o, s in zip(outs, decoder.shapes)]

  def make_dataset():
    ds = builder.as_dataset(split=split, shuffle_files=False)
    return ds.map(one).enumerate().map(lambda i, outs: decoder.pack(i, *outs))

  return data.DatasetSource(make_dataset, num_examples, name)


def _image_decoder(features, image_size):
  channels = features["image"].shape[-1] or 3

  def resize(img):
    img = np.asarray(img)
    if img.ndim == 2:
      img = img[:, :, None]
    h, w = img.shape[:2]
    if (h, w) != (image_size, image_size):
      # Centre square crop, then nearest-neighbour resize: cheap, deterministic.
      side = min(h, w)
      top, left = (h - side) // 2, (w - side) // 2
      rows = top + (np.arange(image_size) * side) // image_size
      cols = left + (np.arange(image_size) * side) // image_size
      img = img[rows][:, cols]
    img = img.astype(np.float32)
    if img.shape[-1] == 3:
      img = (img - IMAGE_MEAN) / IMAGE_STD
    else:
      img = img / 127.5 - 1.0
    return img

  def convert(examples):
    return (np.stack([resize(e["image"]) for e in examples]),
            np.array([e["label"] for e in examples]))

  return _Decoder(convert, (np.float32, np.int32), ((image_size, image_size, channels), ()),
                  lambda idx, image, label: (image, label)), channels


def _text_decoder(tokenizer, seq_len):
  def convert(examples):
    enc = [tokenizer.encode(e["text"], seq_len) for e in examples]
    return np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc])

  return _Decoder(convert, (np.int32, np.int32), ((seq_len,), (seq_len,)),
                  lambda idx, ids, mask: {"input_ids": ids, "input_mask": mask, "index": idx})


def _interactions_decoder(num_dense):
  def convert(examples):
    return (np.stack([e["dense"] for e in examples]),
            np.array([e["user"] for e in examples]), np.array([e["item"] for e in examples]),
            np.array([e["label"] for e in examples]))

  return _Decoder(convert, (np.float32, np.int32, np.int32, np.float32),
                  ((num_dense,), (), (), ()),
                  lambda idx, dense, user, item, label: (
                      {"dense": dense, "user": user, "item": item}, label))


def tfds_dataset(spec: str, *, task: str, data_dir: str | None = None, split: str = "train",
                 image_size: int | None = None, vocab_file: str | None = None,
                 seq_len: int = 128, max_predictions: int = 20, seed: int = 0,
                 num_workers: int = 1) -> Dataset:
  """A prepared TFDS dataset `NAME[:CONFIG]` for a model of `task` (see `tfdp.datasets.load`).

  Raises:
    ConfigError: the dataset is not prepared, lacks `split` or the features
      the model needs, or has fewer files than workers (recommendation).
  """
  builder = tfds_builder(spec, data_dir)
  info = builder.info
  if split not in info.splits:
    raise errors.ConfigError(
        f"TFDS dataset {spec!r} has no split {split!r}; it has {sorted(info.splits)}.")
  features = info.features
  name = f"tfds:{spec}:{split}"
  need = _NEEDS[task]
  missing = [f for f in need if f not in features]
  if missing:
    raise errors.ConfigError(
        f"TFDS dataset {spec!r} has features {sorted(features)}; a {task} model needs "
        f"{list(need)} (missing {missing}). scripts/make_dataset.py shows the expected "
        "layout.")
  n = info.splits[split].num_examples

  if task == models.IMAGE_CLASSIFICATION:
    fixed = features["image"].shape[:2]
    size = image_size or (fixed[0] if fixed[0] and fixed[0] == fixed[1] else 32)
    decoder, channels = _image_decoder(features, size)
    kwargs = {"input_shape": (size, size, channels),
              "num_classes": features["label"].num_classes}
    name += f":{size}"
  elif task == models.MASKED_LM:
    tokenizer = text.WordPiece(vocab_file)
    decoder = _text_decoder(tokenizer, seq_len)
    name += f":{seq_len}"
  else:
    num_dense = features["dense"].shape[-1]
    decoder = _interactions_decoder(num_dense)
    kwargs = {"vocab_sizes": {k: features[k].num_classes for k in ("user", "item")},
              "num_dense": num_dense}

  def random_access_source(index_map=None, source_name=name):
    return TfdsSource(builder.as_data_source(split=split), decoder, source_name,
                      index_map=index_map)

  if not _random_access(builder):
    source = _sequential_source(builder, split, decoder, name + ":sequential", n)
  elif task == models.RECOMMENDATION:
    lengths = list(info.splits[split].shard_lengths)
    if len(lengths) < num_workers:
      raise errors.ConfigError(
          interactions.worker_files_error(spec, split, len(lengths), num_workers))
    source = interactions.FileShardedSource(
        lengths, random_access_source, num_examples=n,
        name=name + f":files/{num_workers}workers")
  else:
    source = random_access_source()
  if task == models.MASKED_LM:
    return text_data.wordpiece_dataset(source, tokenizer, seq_len=seq_len,
                                       max_predictions=max_predictions, seed=seed)
  return Dataset(source, kwargs)
