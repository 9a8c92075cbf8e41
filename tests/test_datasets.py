"""Tests of tfdp.datasets, tfdp.datasets.tokenizer and scripts/make_dataset.py: TFDS from local disk, masks, file sharding, no network."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import models
from tests.conftest import REPO, launch_workers, run_all
from tfdp import data
from tfdp import datasets
from tfdp import errors
from tfdp.datasets import tokenizer as text

MAKE = [sys.executable, os.path.join(REPO, "scripts", "make_dataset.py")]
N = 256


def _make(data_dir, *flags):
  proc = subprocess.run(MAKE + [f"--data_dir={data_dir}", f"--num_examples={N}"] + list(flags),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout.decode()[-3000:]
  return str(data_dir)


def _make_dataset():
  """scripts/make_dataset.py as a module (its writers, without its flags)."""
  scripts = os.path.join(REPO, "scripts")
  if scripts not in sys.path:
    sys.path.insert(0, scripts)
  import make_dataset  # pylint: disable=g-import-not-at-top
  return make_dataset


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """All three modalities, ArrayRecord (random access), interactions in 4 files.

  Written in this process by the writers of scripts/make_dataset.py (as
  `make_dataset.py --num_examples=N --num_shards=4` writes them); the
  script's own command line is run by test_sequential_fallback_for_tfrecord_datasets.
  """
  d = str(tmp_path_factory.mktemp("tfds"))
  make_dataset = _make_dataset()
  make_dataset.write_images(d, num_examples=N)
  make_dataset.write_text(d, num_examples=N)
  make_dataset.write_interactions(d, num_examples=N, num_shards=4)
  return d


@pytest.fixture(scope="module")
def processes(data_dir, tmp_path_factory):
  """This file's other processes, both at once: make_dataset.py writing TFRecord images, 2 workers reading interactions."""
  tmp = tmp_path_factory.mktemp("processes")
  shards = tmp / "shards"
  shards.mkdir()
  made, read = run_all([
      lambda: _make(tmp / "tfrecord", "--modality=images", "--file_format=tfrecord"),
      lambda: launch_workers([sys.executable, "tests/workers/models_shards.py", data_dir,
                              str(shards), "16"], num_workers=2, timeout=300)])
  return {"tfrecord_dir": made, "shards": read, "shards_dir": shards}


@pytest.fixture
def no_network(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError(f"network access attempted: {args}")
  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


def _batches(dataset, start_step, steps, global_batch_size=8, worker=None):
  source = dataset.source if worker is None else dataset.source.for_worker(*worker)
  ds = data.replica_dataset(source, global_batch_size=global_batch_size, seed=3,
                            start_step=start_step, transform=dataset.transform)
  return [tf.nest.map_structure(lambda t: t.numpy(), b) for b in ds.take(steps)]


def _assert_same(a, b):
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_array_equal(x, y)


def test_tfds_images_from_make_dataset(data_dir, no_network):
  make_dataset = _make_dataset()
  d = datasets.load("tfds:tfdp_images", task=models.IMAGE_CLASSIFICATION, data_dir=data_dir)
  assert d.num_examples == N and d.model_kwargs == {"input_shape": (32, 32, 3), "num_classes": 10}
  (images, labels), = _batches(d, 0, 1)
  assert images.shape == (8, 32, 32, 3) and images.dtype == np.float32
  # The pipeline returns the stored examples (normalised), in the data.py order.
  raw_images, raw_labels = make_dataset.image_arrays(N, 32, 10, 0)
  idx = data.example_indices(0, num_examples=N, global_batch_size=8, seed=3).numpy()
  np.testing.assert_array_equal(labels, raw_labels[idx])
  np.testing.assert_allclose(images, (raw_images[idx] - datasets.IMAGE_MEAN) / datasets.IMAGE_STD,
                             rtol=1e-5)
  # Random access: resuming at step 5 gives what a run from 0 saw at step 5.
  _assert_same(_batches(d, 0, 6)[5], _batches(d, 5, 1)[0])
  resized = datasets.load("tfds:tfdp_images", task=models.IMAGE_CLASSIFICATION,
                          data_dir=data_dir, image_size=16)
  assert _batches(resized, 0, 1)[0][0].shape == (8, 16, 16, 3)


def test_tfds_text_through_wordpiece_with_deterministic_masks(data_dir, no_network):
  vocab = os.path.join(data_dir, "tfdp_text_corpus", "vocab.txt")
  d = datasets.load("tfds:tfdp_text", task=models.MASKED_LM, data_dir=data_dir,
                    vocab_file=vocab, seq_len=32)
  tok = text.WordPiece(vocab)
  assert d.model_kwargs == {"vocab_size": tok.vocab_size, "seq_len": 32, "max_predictions": 5}
  run = _batches(d, 0, 4)
  (inputs, labels, weights) = run[0]
  assert inputs["input_ids"].shape == (8, 32) and labels.shape == weights.shape == (8, 5)
  assert (inputs["input_ids"][:, 0] == tok.cls_id).all()
  assert tok.unk_id not in labels[weights > 0]  # the vocabulary covers the corpus
  _assert_same(run[3], _batches(d, 3, 1)[0])  # same masks on resume
  assert not np.array_equal(run[0][0]["masked_positions"], run[1][0]["masked_positions"])
  local = datasets.text_corpus(os.path.join(data_dir, "tfdp_text_corpus", "corpus.txt"),
                               vocab_file=vocab, seq_len=32, max_predictions=5)
  assert local.num_examples == N


def test_masking_is_15_percent_80_10_10_and_independent_of_the_replica_split():
  d = datasets.synthetic_masked_lm(num_examples=256, seq_len=128, seed=1)
  (inputs, labels, weights), = _batches(d, 7, 1, global_batch_size=256)
  raw = d.source.fetch(data.example_indices(7, num_examples=256, global_batch_size=256,
                                            seed=3))
  real = (raw["input_mask"].numpy().sum(1) - 2)  # minus [CLS], [SEP]
  np.testing.assert_array_equal(weights.sum(1), np.clip(np.round(0.15 * real), 1, 19))
  picked = np.take_along_axis(inputs["input_ids"], inputs["masked_positions"], 1)[weights > 0]
  originals = labels[weights > 0]
  assert (np.take_along_axis(raw["input_ids"].numpy(), inputs["masked_positions"], 1)[weights > 0]
          == originals).all()
  masked = (picked == datasets.MASK_ID).mean()
  kept = (picked == originals).mean()
  assert 0.76 < masked < 0.84 and 0.08 < kept < 0.13, (masked, kept)
  # 2 replicas of 4 see the same masks as 1 replica of 8.
  whole = _batches(d, 2, 1)[0]
  halves = data.replica_dataset(d.source, global_batch_size=8, seed=3, start_step=2,
                                transform=d.transform,
                                input_context=tf.distribute.InputContext(1, 0, 2))
  parts = [tf.nest.map_structure(lambda t: t.numpy(), b) for b in halves.take(2)]
  _assert_same(whole, tf.nest.map_structure(lambda a, b: np.concatenate([a, b]), *parts))


@pytest.mark.slow
def test_sequential_fallback_for_tfrecord_datasets(processes, no_network):
  data_dir = processes["tfrecord_dir"]  # make_dataset.py --modality=images --file_format=tfrecord
  d = datasets.load("tfds:tfdp_images", task=models.IMAGE_CLASSIFICATION, data_dir=data_dir)
  assert isinstance(d.source, data.DatasetSource) and not d.source.random_access
  assert d.name.endswith(":sequential")
  strategy = tf.distribute.get_strategy()
  first = [b for _, b in zip(range(4), d.distribute(strategy, global_batch_size=8, seed=0))]
  resumed = next(iter(d.distribute(strategy, global_batch_size=8, seed=0, start_step=3)))
  _assert_same(first[3], resumed)


def test_unprepared_and_unknown_datasets_say_how_to_prepare_offline(tmp_path, no_network):
  with pytest.raises(errors.ConfigError, match=r"not prepared.*tfds build cifar10.*manual_dir"):
    datasets.load("tfds:cifar10", task=models.IMAGE_CLASSIFICATION, data_dir=str(tmp_path))
  with pytest.raises(errors.ConfigError, match="neither a TFDS catalogue name nor prepared"):
    datasets.load("tfds:no_such_set", task=models.IMAGE_CLASSIFICATION, data_dir=str(tmp_path))
  with pytest.raises(errors.ConfigError, match="Unknown --dataset 'imagenet'"):
    datasets.check_name("imagenet")
  with pytest.raises(errors.ConfigError, match="--vocab_file"):
    text.WordPiece(str(tmp_path / "missing.txt"))
  with pytest.raises(errors.ConfigError, match="--vocab_file"):
    text.WordPiece(None)  # --dataset=text:PATH without --vocab_file


def test_feature_mismatch_is_a_config_error(data_dir):
  with pytest.raises(errors.ConfigError, match=r"needs \['text'\]"):
    datasets.load("tfds:tfdp_images", task=models.MASKED_LM, data_dir=data_dir,
                  vocab_file=os.path.join(data_dir, "tfdp_text_corpus", "vocab.txt"))


def test_wordpiece_greedy_longest_match():
  tok = text.WordPiece({t: i for i, t in enumerate(
      list(text.SPECIAL) + ["un", "##aff", "##able", "run", "##ning", ",", "h", "##e"])})
  assert tok.tokenize("Unaffable, running!") == ["un", "##aff", "##able", ",", "run", "##ning",
                                                 "[UNK]"]
  assert tok.tokenize("Héhe") == ["h", "##e", "##h", "##e"] or tok.tokenize("Héhe") == ["[UNK]"]
  ids, mask = tok.encode("run", 6)
  assert ids.tolist() == [tok.cls_id, 8, tok.sep_id, 0, 0, 0] and mask.tolist() == [1, 1, 1, 0, 0, 0]


def test_worker_files_follow_file_sharding():
  lengths = [3, 2, 4, 1]
  np.testing.assert_array_equal(datasets.worker_indices(lengths, 0, 2), [0, 1, 2, 5, 6, 7, 8])
  np.testing.assert_array_equal(datasets.worker_indices(lengths, 1, 2), [3, 4, 9])
  with pytest.raises(errors.ConfigError, match="at least as many files as workers"):
    datasets.worker_indices([5, 5], 0, 3)


def test_fewer_files_than_workers_is_a_config_error(data_dir):
  with pytest.raises(errors.ConfigError, match=r"4 file\(s\), fewer than the 5 workers.*--num_shards=5"):
    datasets.load("tfds:tfdp_interactions", task=models.RECOMMENDATION, data_dir=data_dir,
                  num_workers=5)


def test_interactions_are_read_by_file_per_worker(data_dir):
  make_dataset = _make_dataset()
  d = datasets.load("tfds:tfdp_interactions", task=models.RECOMMENDATION, data_dir=data_dir,
                    num_workers=2)
  assert isinstance(d.source, data.Source) and d.source.random_access
  assert d.num_examples == N and d.name.endswith(":files/2workers")
  mine = d.source.for_worker(1, 2)
  assert mine.num_examples == N // 2 and mine.name == d.name + ":worker1of2"
  # Pipeline 1 of 2 (one replica each) reads 4 examples a step from files 1 and 3 only.
  ctx = tf.distribute.InputContext(2, 1, 2)
  ds = data.replica_dataset(d.source, global_batch_size=8, seed=0, input_context=ctx)
  dense = make_dataset.interaction_arrays(N, 0)["dense"]
  rows = np.concatenate([f["dense"].numpy() for f, _ in ds.take(N // 2 // 4)])
  ids = {int(np.flatnonzero((dense == r).all(1))[0]) for r in rows}
  assert ids == set(range(64, 128)) | set(range(192, 256))


@pytest.mark.slow
def test_two_workers_read_disjoint_interactions_whose_union_is_everything(processes):
  make_dataset = _make_dataset()
  code, out = processes["shards"]  # tests/workers/models_shards.py DATA_DIR OUT 16 on 2 workers
  tmp_path = processes["shards_dir"]
  assert code == 0, out[-5000:]
  assert out.count("SHARD ") == 2 and "files/2workers" in out
  dense = make_dataset.interaction_arrays(N, 0)["dense"]
  seen = []
  for w in range(2):
    rows = np.load(tmp_path / f"worker{w}.npy")
    ids = [int(np.flatnonzero((dense == r).all(1))[0]) for r in rows]
    assert len(set(ids)) == len(ids)  # one epoch: every example once
    seen.append(set(ids))
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(range(N))
  # File sharding: worker w holds files w and w + 2 of the 4 (64 examples each).
  assert seen[0] == set(range(0, 64)) | set(range(128, 192))
