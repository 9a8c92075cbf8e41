"""Data position across processes: the next batches after a restore are the same, per worker."""

import os
import sys

import numpy as np
import pytest

from tests.conftest import WORKERS, launch_workers
from tests.shared import shared_run

SCRIPT = [sys.executable, os.path.join(WORKERS, "resume_batches.py")]


# 96 examples / 8 per step = 12 steps an epoch: K=10 leaves the next M
# batches straddling an epoch boundary (a new permutation).
K, M = 10, 4


@shared_run("batches_runs")
def batches_runs(root):
  """resume_batches.py on 2 workers: "first" takes K steps and saves, then "second" restores.

  Returns {"out": folder, "runs": [[code, log], ...]} (no "second" if "first" failed).
  """
  out = str(root)
  runs = [launch_workers(SCRIPT + [out, "first", str(K), str(M)], num_workers=2)]
  if runs[0][0] == 0:
    runs.append(launch_workers(SCRIPT + [out, "second", str(K), str(M)], num_workers=2))
  return {"out": out, "runs": runs}


@pytest.mark.slow
def test_next_batches_after_restore_in_a_new_process_are_identical_per_worker(batches_runs):
  out = batches_runs["out"]
  for code, log in batches_runs["runs"]:
    assert code == 0, log[-5000:]
  assert len(batches_runs["runs"]) == 2
  for w in (0, 1):
    first = np.load(os.path.join(out, f"first_w{w}.npz"))
    second = np.load(os.path.join(out, f"second_w{w}.npz"))
    assert int(second["start"]) == K
    assert first["images"].shape == (M, 1, 4, 4, 4, 1)  # steps, local replicas, batch
    np.testing.assert_array_equal(first["images"], second["images"])
    np.testing.assert_array_equal(first["labels"], second["labels"])
  w0, w1 = (np.load(os.path.join(out, f"second_w{w}.npz")) for w in (0, 1))
  assert not np.array_equal(w0["images"], w1["images"])  # each worker its own slice


def _first(dataset):
  return next(iter(dataset))


def _write_records(path, values):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.TFRecordWriter(str(path)) as w:
    for v in values:
      w.write(tf.train.Example(features=tf.train.Features(feature={
          "x": tf.train.Feature(int64_list=tf.train.Int64List(value=[v])),
          # Records of different lengths, so offsets are not a multiple of one size.
          "pad": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"p" * (v % 7)])),
      })).SerializeToString())


def _parse(records):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.parse_example(records, {"x": tf.io.FixedLenFeature([], tf.int64)})["x"]


def test_tfrecord_source_reads_any_step_like_an_in_memory_source(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp import data  # pylint: disable=g-import-not-at-top
  _write_records(tmp_path / "a.tfrecord", range(0, 30))
  _write_records(tmp_path / "b.tfrecord", range(30, 48))
  records = data.TFRecordSource([tmp_path / "a.tfrecord", tmp_path / "b.tfrecord"], _parse)
  arrays = data.ArraySource(np.arange(48))
  assert records.num_examples == 48 and "a.tfrecord,b.tfrecord" in records.name
  assert isinstance(records, data.Source) and records.random_access
  ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                                   num_replicas_in_sync=4)
  for step in (0, 7, 10**6):
    kw = dict(global_batch_size=8, seed=4, start_step=step, input_context=ctx)
    got = _first(data.replica_dataset(records, **kw)).numpy()
    want = _first(data.replica_dataset(arrays, **kw)).numpy()
    np.testing.assert_array_equal(got, want)
    assert got.shape == (2,)


def test_compressed_tfrecords_are_refused_with_the_fallback_named(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp import data, errors  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "c.tfrecord.gz")
  with tf.io.TFRecordWriter(path, options="GZIP") as w:
    for i in range(20):
      w.write(b"x" * i)
  with pytest.raises(errors.ConfigError, match="DatasetSource"):
    data.TFRecordSource(path, _parse)


def test_dataset_source_skips_to_the_step_and_slices_per_replica():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp import data  # pylint: disable=g-import-not-at-top
  source = data.DatasetSource(lambda: tf.data.Dataset.range(20), num_examples=20)
  assert isinstance(source, data.Source) and not source.random_access
  # Global batch 4 at step 6 = examples 24..27 of the repeated stream = 4..7;
  # pipeline 1 of 2 (2 replicas each) holds replicas 2 and 3 = [6], [7].
  ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                                   num_replicas_in_sync=4)
  ds = data.replica_dataset(source, global_batch_size=4, seed=0, start_step=6,
                            input_context=ctx)
  got = [x.numpy().tolist() for x in ds.take(4)]
  assert got == [[6], [7], [10], [11]]
  one = tf.distribute.InputContext()
  whole = [x.numpy().tolist() for x in data.replica_dataset(
      source, global_batch_size=4, seed=0, start_step=0, input_context=one).take(8)]
  later = [x.numpy().tolist() for x in data.replica_dataset(
      source, global_batch_size=4, seed=0, start_step=5, input_context=one).take(3)]
  assert later == whole[5:8]
