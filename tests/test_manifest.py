"""The typed manifest: JSON round trip, reading v1/v2 manifests, refusing newer ones."""

import json

import pytest

from tfdp import errors
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format.manifest import FileRecord, Manifest


def test_round_trip():
  m = Manifest(checkpoint_number=4, step=40, metrics={"loss": 0.5}, global_batch_size=32,
               per_worker_keys=["pos"], versions={"tfdp": "x"}, prefix="ckpt-4",
               time=12.5, files=[FileRecord("ckpt-4.index", 10, crc32="0000abcd"),
                                 FileRecord("ckpt-4.data-00000-of-00001", 99, tensors=["a"])],
               num_shards=1, total_bytes=109, state_bytes=90, world_size=2,
               session="s-000001", writers={"0": {"bytes_written": 109, "files": 1}},
               kept=["ckpt-4"])
  text = m.to_json()
  assert json.loads(text)["manifest_version"] == manifest_lib.MANIFEST_VERSION
  assert json.loads(text)["files"][0] == {"name": "ckpt-4.index", "size": 10, "crc32": "0000abcd"}
  assert Manifest.from_json(text) == m


def test_reads_version_1_and_2():
  v1 = {"format": "tfdp-checkpoint", "manifest_version": 1, "prefix": "ckpt-3",
        "checksum": "crc32", "files": [{"name": "ckpt-3.index", "size": 5, "crc32": "01"}],
        "num_shards": 1, "total_bytes": 5, "world_size": 1, "time": 1.0}
  m = Manifest.from_json(json.dumps(v1))
  assert (m.checkpoint_number, m.step, m.metrics, m.files[0].crc32) == (3, 3, {}, "01")
  v2 = dict(v1, manifest_version=2, checkpoint_number=3, step=30, metrics=None,
            kept=["ckpt-3"], files=[{"name": "ckpt-3.data-00000-of-00001", "size": 7,
                                     "tensors": ["k"]}], unknown_field=1)
  m = Manifest.from_json(json.dumps(v2))
  assert (m.step, m.metrics, m.files[0].tensors, m.kept) == (30, {}, ["k"], ["ckpt-3"])


def test_newer_or_foreign_json_is_refused():
  with pytest.raises(errors.CheckpointError, match="newer tfdp"):
    Manifest.from_json(json.dumps({"manifest_version": 99, "prefix": "ckpt-1", "files": []}))
  with pytest.raises(ValueError):
    Manifest.from_json('{"a": 1}')
  with pytest.raises(ValueError):
    Manifest.from_json('{"prefix": "ck')


def test_read_manifest_of_torn_or_missing_file(tmp_path):
  assert manifest_lib.read_manifest(str(tmp_path / "ckpt-1")) is None
  (tmp_path / "ckpt-2.manifest.json").write_text('{"prefix": "ck')
  assert manifest_lib.read_manifest(str(tmp_path / "ckpt-2")) is None
