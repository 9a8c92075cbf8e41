"""Evaluation in tfdp-train: held-out splits of every dataset kind, val_* metrics in TensorBoard and the log, keep_best."""

import json
import os
import re

import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator
import tensorflow as tf

import models
from tfdp import datasets
from tfdp import errors
from tfdp.app import trainer


@pytest.fixture(scope="module")
def runs(train_runs):
  """The shared runs of tests/train_run.py (the train_runs fixture of tests/conftest.py)."""
  return train_runs


def _val(model_dir):
  acc = plugin_event_accumulator.EventAccumulator(
      os.path.join(model_dir, "logs", "validation"),
      size_guidance={plugin_event_accumulator.TENSORS: 0})
  acc.Reload()
  return {tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
          for tag in acc.Tags()["tensors"]}


@pytest.mark.slow
def test_eval_metrics_go_to_tensorboard_at_the_global_step_and_to_the_log(runs):
  val = _val(runs["model_dir"])
  assert set(val) == {"val_loss", "val_accuracy"}
  # Every 5 steps and at the end; the killed run's evaluation at 10 stays.
  assert sorted(val["val_loss"]) == [5, 10, 15, 20, 24]
  logged = {}
  for run in ("killed", "resumed"):
    for m in re.finditer(r"eval \(test, 2 steps\) at step (\d+): val_accuracy (\S+), "
                         r"val_loss (\S+)", runs[run]["stderr"]):
      logged[int(m.group(1))] = float(m.group(3))
  assert sorted(logged) == [5, 10, 15, 20, 24]
  for step, loss in logged.items():
    assert loss == pytest.approx(val["val_loss"][step], rel=1e-3)


@pytest.mark.slow
def test_keep_best_by_val_loss_keeps_the_newest_and_the_two_best(runs):
  model_dir = runs["model_dir"]
  val = _val(model_dir)["val_loss"]
  best_two = sorted(val, key=lambda s: (val[s], -s))[:2]
  kept = sorted(int(f[len("ckpt-"):-len(".manifest.json")]) for f in os.listdir(model_dir)
                if f.startswith("ckpt-") and f.endswith(".manifest.json"))
  assert kept == sorted({24} | set(best_two)), (val, kept)
  for step in kept:
    with open(os.path.join(model_dir, f"ckpt-{step}.manifest.json")) as f:
      metrics = json.load(f)["metrics"]
    assert metrics["val_loss"] == pytest.approx(val[step], rel=1e-6)


def test_synthetic_held_out_split_is_disjoint_and_from_the_same_task():
  def arrays(d, n):
    return d.source.fetch(tf.range(n, dtype=tf.int64))

  train = datasets.load("synthetic", task=models.IMAGE_CLASSIFICATION, num_examples=64, seed=3)
  test = datasets.load("synthetic", task=models.IMAGE_CLASSIFICATION, num_examples=64, seed=3,
                       split="test")
  assert test.num_examples == 16 and test.name != train.name
  assert test.model_kwargs == train.model_kwargs
  (xa, ya), (xb, yb) = arrays(train, 64), arrays(test, 16)
  # No test image is a training image; both are template + noise of the same templates.
  distances = np.sqrt(((xa.numpy()[:, None] - xb.numpy()[None]) ** 2).sum(axis=(2, 3, 4)))
  assert distances.min() > 1.0
  templates = {int(y): x for x, y in zip(xa.numpy(), ya.numpy())}
  nearest = [min(templates, key=lambda c: np.sum((templates[c] - x) ** 2)) for x in xb.numpy()]
  assert np.mean(np.array(nearest) == yb.numpy()) > 0.5
  for task in (models.MASKED_LM, models.RECOMMENDATION):
    a = datasets.load("synthetic", task=task, num_examples=64, seq_len=16)
    b = datasets.load("synthetic", task=task, num_examples=64, seq_len=16, split="test")
    assert b.num_examples == 16 and b.name != a.name
  with pytest.raises(errors.ConfigError, match="splits"):
    datasets.load("synthetic", task=models.IMAGE_CLASSIFICATION, split="validation")


def test_text_corpus_test_split_is_its_last_tenth_and_training_the_rest(tmp_path):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
                             [f"w{i}" for i in range(30)]) + "\n")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(f"w{i % 30} w{(i + 1) % 30}" for i in range(40)) + "\n")
  name = f"text:{corpus}"
  assert datasets.eval_split(name) == "test"
  assert datasets.training_split(name, "test") == "train[:90%]"
  assert datasets.training_split(name, "train[75%:]") == "train[:75%]"
  assert datasets.training_split(name, None) == "train"

  def load(split):
    return datasets.load(name, task=models.MASKED_LM, vocab_file=str(vocab), seq_len=8,
                         split=split)

  full, head, tail = load("train"), load("train[:90%]"), load("test")
  assert (full.num_examples, head.num_examples, tail.num_examples) == (40, 36, 4)
  assert full.name == f"text:{corpus}:8"  # unchanged: earlier checkpoints still resume
  index = lambda d: d.source.features["index"].tolist()
  assert index(head) == list(range(36)) and index(tail) == list(range(36, 40))
  with pytest.raises(errors.ConfigError, match="every line"):
    datasets.eval_split(name, "train")
  with pytest.raises(errors.ConfigError, match="splits"):
    load("validation")


def test_tfds_held_out_split_is_test_else_validation(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def store(name, splits):
    features = tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(8, 8, 3)),
        "label": tfds.features.ClassLabel(num_classes=2)})
    rng = np.random.default_rng(0)
    tfds.dataset_builders.store_as_tfds_dataset(
        name=name, version="1.0.0", features=features, data_dir=str(tmp_path),
        file_format="array_record", disable_shuffling=True,
        split_datasets={s: tf.data.Dataset.from_tensor_slices({
            "image": rng.integers(0, 255, size=(n, 8, 8, 3), dtype=np.uint8),
            "label": np.arange(n) % 2}) for s, n in splits.items()})

  store("tfdp_eval_a", {"train": 8, "validation": 4, "test": 6})
  store("tfdp_eval_b", {"train": 8, "validation": 4})
  store("tfdp_eval_c", {"train": 8})
  data_dir = str(tmp_path)
  assert datasets.eval_split("tfds:tfdp_eval_a", data_dir=data_dir) == "test"
  assert datasets.eval_split("tfds:tfdp_eval_b", data_dir=data_dir) == "validation"
  assert datasets.eval_split("tfds:tfdp_eval_a", "validation", data_dir=data_dir) == "validation"
  with pytest.raises(errors.ConfigError, match="no test or validation split.*--eval_split"):
    datasets.eval_split("tfds:tfdp_eval_c", data_dir=data_dir)
  test = datasets.load("tfds:tfdp_eval_a", task=models.IMAGE_CLASSIFICATION, data_dir=data_dir,
                       split="test")
  assert test.num_examples == 6 and ":test:" in test.name


@pytest.mark.parametrize("flags, message", [
    (dict(keep_best="val_loss:min:3"), "needs --model_dir"),
    (dict(keep_best="val_loss:min:3", model_dir="d"), "set --eval_every_steps"),
    (dict(keep_best="val_loss:min:3", model_dir="d", eval_every_steps=10,
          checkpoint_every_steps=15), "multiple of --eval_every_steps"),
    (dict(keep_best="val_loss:lowest:3", model_dir="d"), "METRIC:min|max:K"),
    (dict(eval_steps=0), "--eval_steps must be >= 1"),
    (dict(eval_split="test"), "take effect with --eval_every_steps"),
])
def test_bad_eval_flags_are_config_errors(flags, message):
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    trainer.TrainConfig(**flags).validate()
