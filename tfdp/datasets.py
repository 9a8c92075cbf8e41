"""Datasets for every model: synthetic with a learnable signal, TFDS (random access) and local text, plugged into tfdp.data.

Every dataset is position-addressable: the batch of global step k is a pure
function of (seed, k), so a resumed run sees exactly the batches it would
have seen. Random choices made per batch (the masked-LM masks) are derived
from (seed, step, example index) in a `transform`, never from a stateful RNG.

TFDS datasets are read with `builder.as_data_source` (ArrayRecord files,
random access: resuming at step k costs O(1)). Datasets prepared in the
TFRecord format have no random access; they are read in file order with
`builder.as_dataset` and resuming skips k * global_batch_size examples
(O(k), unshuffled). Nothing here downloads: an unprepared dataset is a
ConfigError that says how to prepare it offline.

Recommendation datasets from TFDS are sharded by file per worker
(`AutoShardPolicy.FILE` semantics): worker w of N reads files w, w+N, ...
of the split and nothing else. Each worker reads global_batch_size / N
examples per step from its own files, so its data position is a pure
function of the global step: no per-worker state needs checkpointing, but
resuming on another number of workers changes which worker reads what (the
dataset name records N, so the checkpoint's run config refuses that unless
--allow_config_mismatch).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp import errors

SYNTHETIC = "synthetic"
TFDS_PREFIX = "tfds:"
TEXT_PREFIX = "text:"

MASK_RATE = 0.15
SYNTHETIC_VOCAB_SIZE = 1024
SYNTHETIC_TOPICS = 8
SYNTHETIC_TOPIC_WORDS = 16
# Special ids of the synthetic vocabulary (the order of tfdp.text.SPECIAL).
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)

IMAGE_MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
IMAGE_STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A source of examples plus what the model needs to know about them.

  Attributes:
    name: identity of the data, recorded in checkpoints.
    num_examples: examples in one epoch (all workers together).
    model_kwargs: shapes for the model builder (input_shape, num_classes,
      vocab_size, seq_len, max_predictions, vocab_sizes, num_dense).
    source: a `tfdp.data` source (num_examples, fetch) read by all workers.
    transform: `fn(batch, step) -> batch` applied per replica batch.
    worker_source: `fn(worker, num_workers) -> source` for data sharded by
      file per worker (then `source` is None).
    sequential: `fn() -> tf.data.Dataset` of single examples in a fixed
      order, for data without random access (then `source` is None).
  """
  name: str
  num_examples: int
  model_kwargs: dict
  source: object = None
  transform: object = None
  worker_source: object = None
  sequential: object = None

  def distribute(self, strategy, *, global_batch_size, seed, start_step=0):
    """The distributed dataset whose element n is the batch of global step start_step + n."""
    if self.worker_source is not None:
      data.per_replica_batch_size(global_batch_size, strategy.num_replicas_in_sync)
      return strategy.distribute_datasets_from_function(
          lambda ctx: self._worker_dataset(ctx, global_batch_size, seed, start_step))
    source = self.source
    if source is None:
      # No random access: the O(k) fallback of reading and skipping.
      source = data.DatasetSource(self.sequential, self.num_examples, self.name)
    return data.distribute(strategy, source, global_batch_size=global_batch_size,
                           seed=seed, start_step=start_step, transform=self.transform)

  def _worker_dataset(self, ctx, global_batch_size, seed, start_step):
    workers = ctx.num_input_pipelines
    local = ctx.num_replicas_in_sync // workers
    source = self.worker_source(ctx.input_pipeline_id, workers)
    # This worker's files are a dataset of their own, read by its local
    # replicas only: one pipeline, `local` replicas, G / N examples a step.
    return data.replica_dataset(
        source, global_batch_size=global_batch_size // workers, seed=seed,
        start_step=start_step, transform=self.transform,
        input_context=tf.distribute.InputContext(1, 0, local))


def load(name, *, task, seed=0, num_examples=2048, image_size=None, data_dir=None,
         vocab_file=None, seq_len=128, max_predictions=None, num_workers=1, split="train"):
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
    split: TFDS split.

  Returns:
    A Dataset.

  Raises:
    ConfigError: unknown name, a dataset that is not prepared, or features
      the model cannot use; the message says what to do.
  """
  max_predictions = max_predictions or max(1, int(round(seq_len * MASK_RATE)))
  if name == SYNTHETIC:
    if task == "image_classification":
      return synthetic_images(num_examples=num_examples, image_size=image_size or 32, seed=seed)
    if task == "masked_lm":
      return synthetic_masked_lm(num_examples=num_examples, seq_len=seq_len,
                                 max_predictions=max_predictions, seed=seed)
    if task == "recommendation":
      return synthetic_interactions(num_examples=num_examples, seed=seed)
    raise errors.ConfigError(f"No synthetic data for task {task!r}.")
  if name.startswith(TEXT_PREFIX):
    if task != "masked_lm":
      raise errors.ConfigError(f"--dataset={name} is a text corpus; it feeds --model=bert only.")
    return text_corpus(name[len(TEXT_PREFIX):], vocab_file=vocab_file, seq_len=seq_len,
                       max_predictions=max_predictions, seed=seed)
  if name.startswith(TFDS_PREFIX):
    return tfds_dataset(name[len(TFDS_PREFIX):], task=task, data_dir=data_dir, split=split,
                        image_size=image_size, vocab_file=vocab_file, seq_len=seq_len,
                        max_predictions=max_predictions, seed=seed, num_workers=num_workers)
  raise errors.ConfigError(
      f"Unknown --dataset {name!r}; use synthetic, tfds:NAME[:CONFIG] (with "
      "--data_dir) or text:PATH (with --vocab_file).")


def check_name(name):
  """Raises ConfigError if `name` is not a dataset name `load` understands."""
  if not (name == SYNTHETIC or name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX)
          or name.startswith(TEXT_PREFIX) and len(name) > len(TEXT_PREFIX)):
    raise errors.ConfigError(
        f"Unknown --dataset {name!r}; use synthetic, tfds:NAME[:CONFIG] (with "
        "--data_dir) or text:PATH (with --vocab_file).")


# --- Synthetic data ---------------------------------------------------------


def synthetic_images(*, num_examples=2048, image_size=32, num_classes=10, seed=0):
  """Per-class templates plus noise (tfdp.data.synthetic_images) at `image_size`."""
  shape = (image_size, image_size, 3)
  source = data.synthetic_images(num_examples=num_examples, image_shape=shape,
                                 num_classes=num_classes, seed=seed)
  return Dataset(source.name, num_examples, {"input_shape": shape, "num_classes": num_classes},
                 source=source)


def _index_seed(seed, index, salt):
  return tf.stack([tf.constant(seed, tf.int64) * 1000003 + salt, tf.cast(index, tf.int64)])


def synthetic_masked_lm(*, num_examples=2048, seq_len=128, max_predictions=None,
                        vocab_size=SYNTHETIC_VOCAB_SIZE, seed=0):
  """Token sequences with a learnable signal: each is drawn from one of a few topics.

  Sequence i picks a topic and a length in [seq_len/2, seq_len] from (seed,
  i); its tokens are uniform over that topic's 16 words. A masked token is
  thus predictable from the rest of the sequence (loss falls from
  ln(vocab_size) towards ln(16)).
  """
  if seq_len < 8:
    raise errors.ConfigError(f"--seq_len must be >= 8, got {seq_len}.")
  max_predictions = max_predictions or max(1, int(round(seq_len * MASK_RATE)))
  topics = np.random.default_rng(seed).choice(
      np.arange(5, vocab_size), size=(SYNTHETIC_TOPICS, SYNTHETIC_TOPIC_WORDS),
      replace=False).astype(np.int32)

  def fn(indices):
    def one(index):
      s = _index_seed(seed, index, 1)
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
  return Dataset(name, num_examples,
                 {"vocab_size": vocab_size, "seq_len": seq_len, "max_predictions": max_predictions},
                 source=data.FunctionSource(fn, num_examples, name=name),
                 transform=masked_lm_transform(
                     seed=seed, vocab_size=vocab_size, max_predictions=max_predictions,
                     special_ids=(PAD_ID, CLS_ID, SEP_ID), mask_id=MASK_ID))


def masked_lm_transform(*, seed, vocab_size, max_predictions, special_ids, mask_id,
                        rate=MASK_RATE):
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
    key = tf.random.experimental.stateless_fold_in(_index_seed(seed, step, 7), index)
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


def synthetic_interactions(*, num_examples=8192, num_users=1000, num_items=1000,
                           num_dense=8, latent=4, seed=0):
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
      k = _index_seed(seed, index, 3)
      return (tf.random.stateless_normal([num_dense], k),
              tf.random.stateless_normal([], k + [0, 1]))

    dense, noise = tf.map_fn(one, indices, fn_output_signature=(tf.float32, tf.float32))
    score = (tf.reduce_sum(tf.gather(users, user) * tf.gather(items, item), -1)
             + tf.linalg.matvec(dense, tf.constant(w)) + 0.3 * noise)
    return {"dense": dense, "user": user, "item": item}, tf.cast(score > 0, tf.float32)

  name = f"synthetic_interactions:{num_examples}:{num_users}:{num_items}:{num_dense}:{seed}"
  return Dataset(name, num_examples,
                 {"vocab_sizes": {"user": num_users, "item": num_items}, "num_dense": num_dense},
                 source=data.FunctionSource(fn, num_examples, name=name))


# --- Local text corpus ------------------------------------------------------


def _masked_lm_dataset(name, num_examples, tokenizer, seq_len, max_predictions, seed,
                       **kinds):
  return Dataset(
      name, num_examples,
      {"vocab_size": tokenizer.vocab_size, "seq_len": seq_len, "max_predictions": max_predictions},
      transform=masked_lm_transform(
          seed=seed, vocab_size=tokenizer.vocab_size, max_predictions=max_predictions,
          special_ids=(tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id),
          mask_id=tokenizer.mask_id), **kinds)


def text_corpus(path, *, vocab_file, seq_len=128, max_predictions=20, seed=0):
  """A local text file, one example per non-empty line, tokenised once at start-up."""
  from tfdp import text  # pylint: disable=g-import-not-at-top
  tokenizer = text.WordPiece(vocab_file)
  if not tf.io.gfile.exists(path):
    raise errors.ConfigError(f"Text corpus {path!r} not found (--dataset=text:PATH).")
  with tf.io.gfile.GFile(path, "r") as f:
    lines = [l.strip() for l in f if l.strip()]
  if not lines:
    raise errors.ConfigError(f"Text corpus {path} has no non-empty lines.")
  encoded = [tokenizer.encode(l, seq_len) for l in lines]
  arrays = {"input_ids": np.stack([e[0] for e in encoded]),
            "input_mask": np.stack([e[1] for e in encoded]),
            "index": np.arange(len(lines), dtype=np.int64)}
  name = f"text:{path}:{seq_len}"
  return _masked_lm_dataset(name, len(lines), tokenizer, seq_len, max_predictions, seed,
                            source=data.ArraySource(arrays, name=name))


# --- TFDS -------------------------------------------------------------------


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


def tfds_builder(spec, data_dir=None):
  """The prepared TFDS builder of `NAME[:CONFIG]`; ConfigError if it is not prepared."""
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


def _random_access(builder):
  from tensorflow_datasets.core import file_adapters  # pylint: disable=g-import-not-at-top
  fmt = builder.info.file_format
  return fmt is not None and file_adapters.FileFormat(fmt) in (
      file_adapters.FileFormat.ARRAY_RECORD,) + tuple(
          getattr(file_adapters.FileFormat, n) for n in ("PARQUET",)
          if hasattr(file_adapters.FileFormat, n))


class _TfdsSource:
  """Random access to a TFDS split through `as_data_source`; examples converted by `convert`.

  `convert(list of example dicts) -> tuple of numpy arrays` runs in Python
  (tf.numpy_function); `dtypes`/`shapes` describe its outputs (without the
  batch axis) and `pack` turns them into the batch structure.
  """

  def __init__(self, data_source, convert, dtypes, shapes, pack, name, index_map=None):
    self._ds = data_source
    self._convert = convert
    self._dtypes = dtypes
    self._shapes = shapes
    self._pack = pack
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
    return tuple(np.asarray(a, d) for a, d in zip(self._convert(examples), self._dtypes))

  def fetch(self, indices):
    outs = tf.numpy_function(self._read, [indices], list(self._dtypes), stateful=False)
    outs = [tf.ensure_shape(o, (None,) + tuple(s)) for o, s in zip(outs, self._shapes)]
    return self._pack(indices, *outs)


def _image_converter(features, image_size):
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

  return convert, (np.float32, np.int32), ((image_size, image_size, channels), ()), channels


def tfds_dataset(spec, *, task, data_dir=None, split="train", image_size=None,
                 vocab_file=None, seq_len=128, max_predictions=20, seed=0, num_workers=1):
  """A prepared TFDS dataset `NAME[:CONFIG]` for a model of `task` (see `load`)."""
  builder = tfds_builder(spec, data_dir)
  info = builder.info
  if split not in info.splits:
    raise errors.ConfigError(
        f"TFDS dataset {spec!r} has no split {split!r}; it has {sorted(info.splits)}.")
  features = info.features
  name = f"tfds:{spec}:{split}"
  need = {"image_classification": ("image", "label"), "masked_lm": ("text",),
          "recommendation": ("user", "item", "label", "dense")}[task]
  missing = [f for f in need if f not in features]
  if missing:
    raise errors.ConfigError(
        f"TFDS dataset {spec!r} has features {sorted(features)}; a {task} model needs "
        f"{list(need)} (missing {missing}). scripts/make_dataset.py shows the expected "
        "layout.")
  n = info.splits[split].num_examples
  random_access = _random_access(builder)

  if task == "image_classification":
    fixed = features["image"].shape[:2]
    size = image_size or (fixed[0] if fixed[0] and fixed[0] == fixed[1] else 32)
    convert, dtypes, shapes, channels = _image_converter(features, size)
    kwargs = {"input_shape": (size, size, channels),
              "num_classes": features["label"].num_classes}
    pack = lambda idx, image, label: (image, label)
    name += f":{size}"
  elif task == "masked_lm":
    from tfdp import text  # pylint: disable=g-import-not-at-top
    tokenizer = text.WordPiece(vocab_file)
    dtypes, shapes = (np.int32, np.int32), ((seq_len,), (seq_len,))

    def convert(examples):
      enc = [tokenizer.encode(e["text"], seq_len) for e in examples]
      return np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc])

    pack = lambda idx, ids, mask: {"input_ids": ids, "input_mask": mask, "index": idx}
    name += f":{seq_len}"
  else:
    num_dense = features["dense"].shape[-1]
    kwargs = {"vocab_sizes": {k: features[k].num_classes for k in ("user", "item")},
              "num_dense": num_dense}
    dtypes, shapes = (np.float32, np.int32, np.int32, np.float32), (
        (num_dense,), (), (), ())

    def convert(examples):
      return (np.stack([e["dense"] for e in examples]),
              np.array([e["user"] for e in examples]), np.array([e["item"] for e in examples]),
              np.array([e["label"] for e in examples]))

    pack = lambda idx, dense, user, item, label: (
        {"dense": dense, "user": user, "item": item}, label)

  if not random_access:
    return _sequential_tfds(builder, split, name, n, task, convert, dtypes, shapes, pack,
                            kwargs if task != "masked_lm" else None, tokenizer if task == "masked_lm" else None,
                            seq_len, max_predictions, seed)

  def make_source(index_map=None, suffix=""):
    return _TfdsSource(builder.as_data_source(split=split), convert, dtypes, shapes, pack,
                       name + suffix, index_map=index_map)

  if task == "masked_lm":
    return _masked_lm_dataset(name, n, tokenizer, seq_len, max_predictions, seed,
                              source=make_source())
  if task == "recommendation":
    lengths = list(info.splits[split].shard_lengths)
    if len(lengths) < num_workers:
      raise errors.ConfigError(worker_files_error(spec, split, len(lengths), num_workers))
    name += f":files/{num_workers}workers"

    def worker_source(worker, workers):
      index_map = worker_indices(lengths, worker, workers)
      return make_source(index_map, f":worker{worker}of{workers}")

    return Dataset(name, n, kwargs, worker_source=worker_source)
  return Dataset(name, n, kwargs, source=make_source())


def worker_files_error(spec, split, num_files, num_workers):
  return (f"TFDS dataset {spec!r} split {split!r} has {num_files} file(s), fewer than "
          f"the {num_workers} workers; each worker reads whole files. Write it with at "
          f"least {num_workers} shards (scripts/make_dataset.py --num_shards="
          f"{num_workers}) or use fewer workers.")


def worker_indices(shard_lengths, worker, num_workers):
  """Example indices of the files worker `worker` reads: files worker, worker + N, ....

  `AutoShardPolicy.FILE` semantics over a split whose file f holds
  `shard_lengths[f]` consecutive examples.

  Raises:
    ConfigError: fewer files than workers.
  """
  if len(shard_lengths) < num_workers:
    raise errors.ConfigError(
        f"{len(shard_lengths)} file(s) cannot be shared by {num_workers} workers; "
        "each worker reads whole files. Write the data in at least as many files as "
        "workers, or use fewer workers.")
  starts = np.concatenate([[0], np.cumsum(shard_lengths)])
  return np.concatenate([np.arange(starts[f], starts[f + 1], dtype=np.int64)
                         for f in range(worker, len(shard_lengths), num_workers)])


def _sequential_tfds(builder, split, name, n, task, convert, dtypes, shapes, pack, kwargs,
                     tokenizer, seq_len, max_predictions, seed):
  """Fallback for TFRecord-format datasets: file order, resume by skipping (O(k))."""

  def sequential():
    ds = builder.as_dataset(split=split, shuffle_files=False)

    def one(example):
      def py(*flat):
        ex = dict(zip(keys, flat))
        return tuple(np.asarray(a[0], d) for a, d in zip(convert([ex]), dtypes))
      outs = tf.numpy_function(py, [example[k] for k in keys], list(dtypes), stateful=False)
      outs = [tf.ensure_shape(o, s) for o, s in zip(outs, shapes)]
      return outs

    keys = sorted(builder.info.features.keys())
    return ds.map(one).enumerate().map(lambda i, outs: pack(i, *outs))

  name += ":sequential"
  if task == "masked_lm":
    return _masked_lm_dataset(name, n, tokenizer, seq_len, max_predictions, seed,
                              sequential=sequential)
  return Dataset(name, n, kwargs, sequential=sequential)
