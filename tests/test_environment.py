"""Tests of tfdp.distribute.environment: TF_CONFIG parsing, chief and worker numbering, the unchecked read for error paths."""

import json

from tfdp.distribute import environment


def _tf_config(workers, index):
  return json.dumps({"cluster": {"worker": [f"localhost:{3000 + i}" for i in range(workers)]},
                     "task": {"type": "worker", "index": index}})


def test_tf_config_parsing():
  assert environment.parse_tf_config("") is None
  config = environment.parse_tf_config(_tf_config(3, 2))
  assert environment.num_cluster_workers(config) == 3


def test_chief_and_worker_numbering():
  with_chief = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
  assert environment.worker_index("chief", 0, with_chief) == 0
  assert environment.worker_index("worker", 0, with_chief) == 1
  assert environment.worker_index("worker", 1, with_chief) == 2
  assert environment.worker_index("worker", 1, {"worker": ["w:1", "w:2"]}) == 1
  assert environment.chief_task({"cluster": with_chief}) == ("chief", 0)
  assert environment.chief_task({"cluster": {"worker": ["w:1"]}}) == ("worker", 0)
  assert environment.num_cluster_workers({"cluster": with_chief}) == 3


def test_unchecked_tf_config_for_error_paths(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert environment.tf_config_or_empty() == {}
  monkeypatch.setenv("TF_CONFIG", "{not json")
  assert environment.tf_config_or_empty() == {}
  monkeypatch.setenv("TF_CONFIG", _tf_config(2, 1))
  assert environment.own_task(environment.tf_config_or_empty()) == ("worker", 1)
