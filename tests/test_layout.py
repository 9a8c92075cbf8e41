"""Layout: every file name of a checkpoint directory, and what a name is."""

import os

import pytest

from tfdp.checkpoint.format import directory
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format.layout import Layout


def test_names_of_a_checkpoint():
  lay = Layout("/d", "ckpt")
  p = lay.prefix(7)
  assert p == "/d/ckpt-7"
  assert layout_lib.index_path(p) == "/d/ckpt-7.index"
  assert layout_lib.data_filename(p, 1, 3) == "/d/ckpt-7.data-00001-of-00003"
  assert layout_lib.manifest_path(p) == "/d/ckpt-7.manifest.json"
  assert layout_lib.corrupt_path(p) == "/d/ckpt-7.manifest.json.corrupt"
  assert lay.lease_path == "/d/.tfdp-lease.json" and lay.state_path == "/d/checkpoint"
  tmp = lay.tmp_dir("abc-000002", 7)
  assert tmp == "/d/.tfdp-tmp/abc-000002-ckpt-7"
  assert lay.tmp_base(os.path.basename(tmp)) == "ckpt-7"
  assert lay.marker_path(tmp, 1) == tmp + "/w00001.done.json"
  assert lay.failed_path(tmp) == tmp + "/FAILED.json"
  assert lay.shard_prefix(tmp, 1, 2) == tmp + "/w00001-00002"
  assert layout_lib.number_of(p) == 7
  assert layout_lib.per_worker_prefix(3) == "_tfdp_per_worker/3/"


def test_parse_kinds_and_names():
  lay = Layout("/d", "ckpt")
  want = {"ckpt-3.index": "index", "ckpt-3.data-00000-of-00002": "data",
          "ckpt-3.manifest.json": "manifest", "ckpt-3.manifest.json.tmp-42": "manifest_tmp",
          "ckpt-3.manifest.json.corrupt": "corrupt",
          "ckpt-3.data-00000-of-00001.tempstate1828745764989108356": "tf_tmp",
          "ckpt-3.index.tempstate42": "tf_tmp"}
  for name, kind in want.items():
    parsed = lay.parse(name)
    assert (parsed.base, parsed.number, parsed.kind) == ("ckpt-3", 3, kind), name
  for other in ("checkpoint", ".tfdp-lease.json", "model-3.index", "ckpt-3.txt", "ckpt-x.index"):
    assert lay.parse(other) is None, other
  anyname = Layout("/d", None).parse("my-model-12.index")
  assert (anyname.base, anyname.number) == ("my-model-12", 12)


def test_scan_and_files_of(tmp_path):
  for name in ("ckpt-1.index", "ckpt-1.data-00000-of-00001", "ckpt-1.manifest.json",
               "ckpt-2.index", "checkpoint", "notes.txt"):
    (tmp_path / name).write_text("x")
  lay = Layout(str(tmp_path), "ckpt")
  assert directory.scan(lay) == {"ckpt-1": {"index", "data", "manifest"}, "ckpt-2": {"index"}}
  assert sorted(os.path.basename(p) for p in directory.files_of(lay, lay.prefix(1))) == [
      "ckpt-1.data-00000-of-00001", "ckpt-1.index"]


def test_cleanup_removes_what_a_killed_tf_write_left_in_a_local_tier(tmp_path):
  """TF's SaveV2 writes `<file>.tempstate<N>` then renames it: a SIGKILL mid-write leaves one."""
  from tfdp.checkpoint.format import commit as commit_lib  # pylint: disable=g-import-not-at-top
  names = ["ckpt-30.data-00000-of-00001.tempstate1828745764989108356", "ckpt-29.index",
           "ckpt-29.data-00000-of-00001", "ckpt-29.manifest.json"]
  for name in names:
    (tmp_path / name).write_text("x")
  commit_lib.cleanup(Layout(str(tmp_path), "ckpt"), private=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
  # Outside a private folder a TF temp file is another writer's: it stays.
  (tmp_path / names[0]).write_text("x")
  commit_lib.cleanup(Layout(str(tmp_path), "ckpt"))
  assert (tmp_path / names[0]).exists()


def test_the_state_file_reads_as_tf_reads_it(tmp_path):
  """directory.read_state (tfdp-ckpt ls and the catalog, without TensorFlow) agrees with TF's own parse."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=g-import-not-at-top
  checkpoint_management.update_checkpoint_state_internal(
      save_dir=str(tmp_path), model_checkpoint_path=str(tmp_path / "ckpt-3"),
      all_model_checkpoint_paths=[str(tmp_path / f"ckpt-{n}") for n in (1, 2, 3)],
      all_model_checkpoint_timestamps=[1796618125.305399, 1796618126.5, 1796618127.25],
      last_preserved_timestamp=1796618120.125, save_relative_paths=True)
  tf_state = tf.train.get_checkpoint_state(str(tmp_path))
  ours = directory.read_state(str(tmp_path))
  assert os.path.join(str(tmp_path), ours.latest) == tf_state.model_checkpoint_path
  assert [os.path.join(str(tmp_path), p) for p in ours.paths] == list(
      tf_state.all_model_checkpoint_paths)
  assert ours.timestamps == list(tf_state.all_model_checkpoint_timestamps)
  assert ours.last_preserved == tf_state.last_preserved_timestamp
  assert directory.read_state(str(tmp_path / "none")) is None
  # A name protobuf writes as raw UTF-8, as octal escapes, or with a quote (review of the house).
  for name in ("modèle-5", 'a"b-5'):
    checkpoint_management.update_checkpoint_state_internal(
        save_dir=str(tmp_path), model_checkpoint_path=str(tmp_path / name),
        all_model_checkpoint_paths=[str(tmp_path / name)], save_relative_paths=True)
    assert directory.read_state(str(tmp_path)).latest == name
    assert tf.train.get_checkpoint_state(str(tmp_path)).model_checkpoint_path == str(tmp_path / name)
  (tmp_path / "checkpoint").write_text('model_checkpoint_path: "mod\\303\\250le-5"\n')
  assert directory.read_state(str(tmp_path)).latest == "modèle-5"
  (tmp_path / "checkpoint").write_text("garbage without a colon\n")
  with pytest.raises(ValueError):
    directory.read_state(str(tmp_path))


def test_a_delete_that_fails_leaves_the_checkpoint_committed_and_raises_nothing(tmp_path):
  """commit.delete (retention, a save replacing a number) warns where the file system refuses.

  Its except clause named a function fs does not have: any refusal became a
  TypeError that failed the save (review of the house). A directory where
  the manifest should be is a real refusal (unlink: EISDIR), even as root.
  """
  from tfdp.checkpoint.format import commit  # pylint: disable=g-import-not-at-top
  layout = Layout(str(tmp_path), "ckpt")
  prefix = str(tmp_path / "ckpt-3")
  os.mkdir(layout_lib.manifest_path(prefix))
  open(layout_lib.index_path(prefix), "w").close()
  commit.delete(layout, prefix)
  assert os.path.exists(layout_lib.index_path(prefix))  # Still committed: its files stay.
  os.rmdir(layout_lib.manifest_path(prefix))
  open(layout_lib.manifest_path(prefix), "w").close()
  commit.delete(layout, prefix)
  assert not os.listdir(tmp_path)
