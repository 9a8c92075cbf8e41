"""Tests of tfdp.data: order is a function of (seed, step), topology-independent, O(1) to resume."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfdp import data
from tfdp import errors
from tests.conftest import REPO

G = 16


def _src():
  return data.synthetic_images(num_examples=128, image_shape=(4, 4, 1), num_classes=4, seed=5)


def _batches(pipelines, pipeline_id, replicas, steps, start=0, seed=1):
  ds = data.replica_dataset(
      _src(), global_batch_size=G, seed=seed, start_step=start,
      input_context=tf.distribute.InputContext(pipelines, pipeline_id, replicas))
  return [(x.numpy(), y.numpy()) for x, y in ds.take(steps * replicas // pipelines)]


def _global_batches(pipelines, replicas, steps, start=0):
  """Reassembles the global batch of each step from every pipeline's elements."""
  local = replicas // pipelines
  per_pipeline = [_batches(pipelines, p, replicas, steps, start) for p in range(pipelines)]
  out = []
  for s in range(steps):
    parts = [per_pipeline[p][s * local + j] for p in range(pipelines) for j in range(local)]
    out.append((np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])))
  return out


def test_global_batch_is_the_same_on_every_topology():
  reference = _global_batches(1, 1, 3)
  for pipelines, replicas in [(1, 2), (2, 2), (4, 4), (2, 4)]:
    for (x, y), (rx, ry) in zip(_global_batches(pipelines, replicas, 3), reference):
      np.testing.assert_array_equal(y, ry)
      np.testing.assert_array_equal(x, rx)


def test_resume_at_step_k_continues_the_sequence():
  full = _global_batches(2, 2, 6)
  resumed = _global_batches(2, 2, 3, start=3)
  for (x, y), (rx, ry) in zip(resumed, full[3:]):
    np.testing.assert_array_equal(x, rx)
    np.testing.assert_array_equal(y, ry)


def test_each_epoch_is_a_permutation_and_epochs_differ():
  spe = data.steps_per_epoch(128, G)
  epochs = [np.concatenate([data.example_indices(e * spe + s, num_examples=128,
                                                 global_batch_size=G, seed=1).numpy()
                            for s in range(spe)]) for e in range(2)]
  for idx in epochs:
    assert sorted(idx) == list(range(128))
  assert not np.array_equal(epochs[0], epochs[1])
  other_seed = np.concatenate([data.example_indices(s, num_examples=128, global_batch_size=G,
                                                    seed=2).numpy() for s in range(spe)])
  assert not np.array_equal(epochs[0], other_seed)


def test_far_positions_are_reachable_directly():
  idx = data.example_indices(10**12, num_examples=128, global_batch_size=G, seed=1).numpy()
  assert len(idx) == G and idx.min() >= 0 and idx.max() < 128
  (x, _), = _batches(1, 0, 1, 1, start=10**12)
  assert x.shape == (G, 4, 4, 1)


def test_array_source_and_errors():
  src = data.ArraySource({"a": np.arange(10), "b": np.arange(10) * 2})
  batch = src.fetch(tf.constant([3, 1], tf.int64))
  assert batch["a"].numpy().tolist() == [3, 1] and batch["b"].numpy().tolist() == [6, 2]
  with pytest.raises(errors.ConfigError, match="same length"):
    data.ArraySource((np.arange(3), np.arange(4)))
  with pytest.raises(errors.ConfigError, match="positive multiple of the 3 replicas"):
    data.per_replica_batch_size(16, 3)
  with pytest.raises(errors.ConfigError, match="fewer than one global batch"):
    data.steps_per_epoch(10, 16)


def test_every_source_is_a_source_that_says_how_it_resumes():
  sources = [data.ArraySource(np.arange(32)), data.FunctionSource(lambda i: i, 32),
             data.DatasetSource(lambda: tf.data.Dataset.range(32), num_examples=32)]
  assert all(isinstance(s, data.Source) for s in sources)
  assert [s.random_access for s in sources] == [True, True, False]


def test_a_random_access_source_of_ones_own_needs_only_fetch():
  class Squares(data.RandomAccessSource):
    name = "squares"
    num_examples = 32

    def fetch(self, indices):
      return indices * indices

  assert isinstance(Squares(), data.Source)
  ctx = tf.distribute.InputContext(1, 0, 2)
  ds = data.replica_dataset(Squares(), global_batch_size=8, seed=0, start_step=3,
                            input_context=ctx)
  want = data.example_indices(3, num_examples=32, global_batch_size=8, seed=0).numpy()
  np.testing.assert_array_equal(np.concatenate([x.numpy() for x in ds.take(2)]), want ** 2)


def test_local_replicas_split_features_of_unknown_shape():
  # A py_function source gives features whose inner shape is unknown until
  # run time; each local replica must still get its slice of the batch.
  def fn(indices):
    x = tf.py_function(lambda i: np.repeat(i.numpy()[:, None], 3, axis=1),
                       [indices], tf.int64)
    return x, indices

  src = data.FunctionSource(fn, 64)
  ctx = tf.distribute.InputContext(1, 0, 2)
  ds = data.replica_dataset(src, global_batch_size=8, seed=0, input_context=ctx)
  (x0, i0), (x1, i1) = [(x.numpy(), i.numpy()) for x, i in ds.take(2)]
  want = data.example_indices(0, num_examples=64, global_batch_size=8, seed=0).numpy()
  np.testing.assert_array_equal(np.concatenate([i0, i1]), want)
  np.testing.assert_array_equal(x0, np.repeat(i0[:, None], 3, axis=1))
  np.testing.assert_array_equal(x1, np.repeat(i1[:, None], 3, axis=1))


@pytest.mark.slow
def test_array_source_made_before_the_strategy():
  # Making a source must not initialise TensorFlow: cpu_replicas is set after.
  script = (
      "import numpy as np, tfdp\n"
      "src = tfdp.data.ArraySource((np.zeros((64, 3), np.float32), np.arange(64)))\n"
      "s = tfdp.make_strategy('mirrored', cpu_replicas=2)\n"
      "x, i = next(iter(tfdp.data.distribute(s, src, global_batch_size=8, seed=0)))\n"
      "print('OK', s.num_replicas_in_sync, len(s.experimental_local_results(i)))\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        timeout=120, check=False)
  out = proc.stdout.decode()
  assert proc.returncode == 0 and "OK 2 2" in out, out[-2000:]
