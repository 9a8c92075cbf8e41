"""Tests of tfdp.distribute.strategy: the pure choice of kind (every branch and error), each builder, each bad input, multi-worker cpu_replicas."""

import json

import pytest
import tensorflow as tf

from tests import identity_run
from tfdp import cluster
from tfdp import errors
from tfdp.distribute import strategy as S


def _tf_config(n=2, index=0):
  return json.dumps({"cluster": {"worker": [f"localhost:{2000 + i}" for i in range(n)]},
                     "task": {"type": "worker", "index": index}})


@pytest.fixture
def no_tf_config(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)


def test_mirrored_over_cpu_replicas(no_tf_config):
  s = S.make_strategy("mirrored", cpu_replicas=2)
  assert isinstance(s, tf.distribute.MirroredStrategy)
  assert s.num_replicas_in_sync == 2
  w = cluster.resolve(s)
  assert (w.index, w.count, w.is_chief) == (0, 1, True)


def test_auto_picks_mirrored_with_cpu_replicas_else_default(no_tf_config):
  assert isinstance(S.make_strategy("auto", cpu_replicas=2), tf.distribute.MirroredStrategy)
  default = S.make_strategy("auto")
  assert default is tf.distribute.get_strategy()
  assert default.num_replicas_in_sync == 1


def test_one_device_and_default(no_tf_config):
  s = S.make_strategy("one_device")
  assert isinstance(s, tf.distribute.OneDeviceStrategy)
  assert S.make_strategy("default").num_replicas_in_sync == 1


@pytest.mark.parametrize("all_reduce", ["auto", "hierarchical_copy", "reduce_to_one", "ring"])
def test_mirrored_all_reduce_methods_sum_correctly(no_tf_config, all_reduce):
  s = S.make_strategy("mirrored", cpu_replicas=2, all_reduce=all_reduce)
  result = s.run(lambda: tf.distribute.get_replica_context().all_reduce(
      "SUM", tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)))
  assert [float(x) for x in s.experimental_local_results(result)] == [3.0, 3.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="bogus"), "Unknown strategy 'bogus'"),
    (dict(all_reduce="butterfly"), "Unknown all_reduce 'butterfly'"),
    (dict(all_reduce="nccl"), "needs GPUs and none is visible"),
    (dict(kind="multi_worker"), "needs TF_CONFIG"),
    (dict(kind="mirrored", cpu_replicas=3), "already initialised its devices"),
    (dict(kind="mirrored", cpu_replicas=0), "positive integer"),
])
def test_bad_arguments_raise_config_error(no_tf_config, kwargs, match):
  with pytest.raises(errors.ConfigError, match=match):
    S.make_strategy(**kwargs)


def test_single_host_kind_with_multi_worker_tf_config(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", _tf_config(2))
  with pytest.raises(errors.ConfigError, match="describes 2 workers"):
    S.make_strategy("mirrored", cpu_replicas=2)


def test_multi_worker_after_tensorflow_started_is_one_clear_error(monkeypatch):
  """TF says "Collective ops must be configured at program startup"; tfdp says what to move."""
  monkeypatch.setenv("TF_CONFIG", _tf_config(2))
  tf.constant(1.0)  # TF has started (a dataset or model built before the strategy).
  with pytest.raises(errors.ConfigError, match="right after the imports, before building any "
                     "tf.data dataset"):
    S.make_strategy()


def test_hierarchical_copy_across_workers_is_refused():
  with pytest.raises(errors.ConfigError, match="not available across workers"):
    S.communication_options("hierarchical_copy")


@pytest.mark.parametrize("raw, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"task": {"type": "worker", "index": 0}}', "no `cluster`"),
    ('{"cluster": {"worker": ["localhost:1"]}}', "no `task`"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}',
     "is not 'host:port'"),
    ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}',
     "twice"),
    ('{"cluster": {"worker": ["a:1", "a:2"]}, "task": {"type": "worker", "index": 2}}',
     r"index must be in \[0, 1\]"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     "not a job of the cluster"),
    ('{"cluster": {"worker": ["a:1"], "ps": ["a:2"]}, "task": {"type": "worker", "index": 0}}',
     "parameter servers"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}',
     "must be an integer"),
])
def test_bad_tf_config(monkeypatch, raw, match):
  monkeypatch.setenv("TF_CONFIG", raw)
  with pytest.raises(errors.ConfigError, match=match):
    S.make_strategy("auto")


@pytest.mark.parametrize("kind, workers, gpus, cpu_replicas, expected", [
    ("auto", 2, 0, None, "multi_worker"),
    ("auto", 2, 4, 2, "multi_worker"),
    ("auto", None, 2, None, "mirrored"),
    ("auto", None, 0, 2, "mirrored"),
    ("auto", 1, 0, 2, "mirrored"),
    ("auto", None, 1, 4, "one_device"),
    ("auto", None, 0, None, "default"),
    ("auto", None, 0, 1, "default"),
    ("auto", 1, 0, None, "default"),
    ("multi_worker", 1, 0, None, "multi_worker"),
    ("multi_worker", 3, 0, None, "multi_worker"),
    ("mirrored", None, 0, None, "mirrored"),
    ("one_device", None, 0, None, "one_device"),
    ("default", 1, 2, None, "default"),
])
def test_choose_kind(kind, workers, gpus, cpu_replicas, expected):
  assert S.choose_kind(kind, tf_config_workers=workers, num_gpus=gpus,
                       cpu_replicas=cpu_replicas) == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="bogus"), "Unknown strategy 'bogus'"),
    (dict(all_reduce="butterfly"), "Unknown all_reduce 'butterfly'"),
    (dict(all_reduce="nccl"), "needs GPUs and none is visible"),
    (dict(kind="multi_worker"), "needs TF_CONFIG"),
    (dict(kind="mirrored", tf_config_workers=2), "describes 2 workers but strategy 'mirrored'"),
    (dict(kind="one_device", tf_config_workers=3), "describes 3 workers"),
    (dict(kind="default", tf_config_workers=2), "describes 2 workers"),
])
def test_choose_kind_errors(kwargs, match):
  args = dict(kind="auto", tf_config_workers=None, num_gpus=0)
  args.update(kwargs)
  kind = args.pop("kind")
  with pytest.raises(errors.ConfigError, match=match):
    S.choose_kind(kind, **args)


def test_choose_kind_accepts_nccl_with_gpus():
  assert S.choose_kind("auto", tf_config_workers=None, num_gpus=2,
                       all_reduce="nccl") == "mirrored"


def test_default_bytes_per_pack():
  assert S.default_bytes_per_pack("ring", have_gpus=True) == 4 << 20
  assert S.default_bytes_per_pack("auto", have_gpus=False) == 4 << 20
  assert S.default_bytes_per_pack("auto", have_gpus=True) == 0
  assert S.default_bytes_per_pack("nccl", have_gpus=True) == 0


def test_peer_timeout_must_be_positive(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", _tf_config(1))
  with pytest.raises(errors.ConfigError, match="peer_timeout_seconds must be positive"):
    S.make_strategy("multi_worker", peer_timeout_seconds=0)


@pytest.mark.slow
def test_multi_worker_with_two_cpu_replicas_each():
  code, out, results = identity_run.results("strategy")
  assert code == 0, out[-5000:]
  # 4 replicas in sync (2 workers x 2), ids 0..3 sum to 6 on every replica;
  # ring collectives get the default 4 MB gradient packs.
  assert results == [
      "_MultiWorkerCpuReplicasStrategy 4 (0, 2, True) [6.0, 6.0] pack 4194304",
      "_MultiWorkerCpuReplicasStrategy 4 (1, 2, False) [6.0, 6.0] pack 4194304",
  ], out[-5000:]
