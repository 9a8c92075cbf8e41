"""The save planner: which worker writes which tensors into which files (no processes, no TF runtime)."""

import pytest

from tfdp.checkpoint.format import planner
from tfdp.checkpoint.format.planner import Item


def _items(sizes):
  return [Item(f"k{i:02d}", "", None, n) for i, n in enumerate(sizes)]


def test_every_item_once_and_byte_balanced():
  items = _items([100, 90, 80, 70, 60, 50, 40, 30, 20, 10]) + [
      Item(planner.OBJECT_GRAPH_KEY, "", None, 5)]
  plan = planner.plan_save(items, 3)
  keys = [it.key for w in range(3) for f in plan.files[w] for it in f]
  assert sorted(keys) == sorted(it.key for it in items)
  loads = [sum(it.nbytes for f in plan.files[w] for it in f) for w in range(3)]
  assert max(loads) - min(loads) <= 20, loads
  assert any(it.key == planner.OBJECT_GRAPH_KEY for f in plan.files[0] for it in f)


def test_same_plan_on_every_worker_whatever_the_order():
  items = _items([7, 300, 5, 300, 42, 9])
  a = planner.plan_save(items, 2)
  b = planner.plan_save(list(reversed(items)), 2)
  assert [[[it.key for it in f] for f in w] for w in a.files] == \
         [[[it.key for it in f] for f in w] for w in b.files]


def test_max_shard_bytes_caps_files_but_a_big_tensor_gets_its_own():
  plan = planner.plan_save(_items([400, 300, 300, 1000, 100]), 1, max_shard_bytes=500)
  sizes = [sum(it.nbytes for it in f) for f in plan.files[0]]
  assert 1000 in sizes
  assert all(s <= 500 for s in sizes if s != 1000), sizes
  assert sum(sizes) == 2100


def test_parallel_files_only_when_each_is_big_enough(monkeypatch):
  monkeypatch.setattr(planner, "PARALLEL_FILES", 4)
  monkeypatch.setattr(planner, "PARALLEL_MIN_FILE_BYTES", 1000)
  assert len(planner.plan_save(_items([300] * 8), 1).files[0]) == 2
  assert len(planner.plan_save(_items([300] * 3), 1).files[0]) == 1
  assert len(planner.plan_save(_items([1000] * 10), 1).files[0]) == 4


def test_a_worker_without_tensors_writes_no_file_and_local_items_stay_local():
  local = [Item("_tfdp_per_worker/1/pos", "", None, 8)]
  plan = planner.plan_save(_items([10]), 3, local_items={1: local})
  assert plan.files[2] == ()
  assert [it.key for f in plan.files[1] for it in f] == ["_tfdp_per_worker/1/pos"]
  assert plan.num_workers == 3 and plan.for_worker(0)[0][0].key == "k00"


@pytest.mark.parametrize("cap", [None, 1])
def test_no_items_no_files(cap):
  assert planner.plan_save([], 2, max_shard_bytes=cap).files == ((), ())
