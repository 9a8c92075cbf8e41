"""One fallback rule for every way a checkpoint can be broken, through restore_or_initialize."""

import io
import logging
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tfdp import errors
from tfdp.resume import train_state as state_lib
from tfdp.checkpoint import CheckpointManager


def _state(value):
  return tf.train.Checkpoint(v=tf.Variable(np.full(5000, value, np.float32)),
                             run_config=state_lib._JsonState({"seed": 1}))  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """ckpt-1 (all 1s) and ckpt-2 (all 2s), shared by every case."""
  d = str(tmp_path_factory.mktemp("fallback") / "base")
  ckpt = _state(1.0)
  with CheckpointManager(ckpt, d) as mgr:
    mgr.save()
    ckpt.v.assign(tf.fill([5000], 2.0))
    mgr.save()
  return d


def _flip(path, offset=100):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))


def _garble(path):
  with open(path, "r+b") as f:
    size = os.path.getsize(path)
    f.seek(size // 3)
    f.write(b"\xde\xad" * 8)


DATA, INDEX, MANIFEST = ".data-00000-of-00001", ".index", ".manifest.json"
# kind -> (damage of ckpt-2, the file a warning must name)
BROKEN = {
    "truncated data": (lambda p: os.truncate(p + DATA, 1000), DATA),
    "missing data": (lambda p: os.remove(p + DATA), DATA),
    "missing index": (lambda p: os.remove(p + INDEX), INDEX),
    "corrupt index": (lambda p: _garble(p + INDEX), INDEX),
    "flipped byte": (lambda p: _flip(p + DATA), DATA),
}


def _fresh(base, tmp_path):
  d = str(tmp_path / "model")
  shutil.copytree(base, d)
  return d, os.path.join(d, "ckpt-2")


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_newest_is_set_aside_and_the_older_one_used(base, tmp_path, kind, caplog):
  d, newest = _fresh(base, tmp_path)
  damage, bad_file = BROKEN[kind]
  damage(newest)
  ckpt = _state(0.0)
  mgr = CheckpointManager(ckpt, d)
  with caplog.at_level(logging.WARNING):
    assert mgr.restore_or_initialize() == os.path.join(d, "ckpt-1")
  assert np.all(ckpt.v.numpy() == 1.0)
  # The values before the failed attempt are let go once a restore succeeded
  # (kept, they would hold a second copy of the state for the whole run).
  assert mgr._restorer._initial is None  # pylint: disable=protected-access
  assert "(set aside: " in caplog.text and newest + bad_file in caplog.text
  assert os.path.exists(newest + MANIFEST + ".corrupt")
  assert mgr.checkpoints == [os.path.join(d, "ckpt-1")]
  assert tf.train.latest_checkpoint(d) == os.path.join(d, "ckpt-1")
  # A restart does not trip over it, and training saves past it.
  assert os.path.basename(mgr.save(checkpoint_number=2)) == "ckpt-2"
  again = CheckpointManager(_state(0.0), d)
  assert again.restore_or_initialize() == newest


def test_unreadable_run_config_sizes_checked_before_any_read(base, tmp_path):
  """The run-config check of tfdp-train and BackupAndRestore runs after the size check."""
  d, newest = _fresh(base, tmp_path)
  os.truncate(newest + DATA, 10)
  with pytest.raises(IndexError):
    state_lib.read_run_config(newest)  # What killed tfdp-train before.
  seen = []

  def before_restore(prefix):
    seen.append(os.path.basename(prefix))
    assert state_lib.check_checkpoint(_Run(), prefix) == []

  mgr = CheckpointManager(_state(0.0), d)
  assert mgr.restore_newest_intact(before_restore) == os.path.join(d, "ckpt-1")
  assert seen == ["ckpt-1"]


class _Run:
  run_config = {"seed": 1}
  check_compatible = state_lib.TrainState.check_compatible


def test_a_newest_without_a_manifest_is_restored_as_tfs_own(base, tmp_path):
  """Its bytes are intact: TF's state file lists it and TF's CRC32C checks every tensor."""
  d, newest = _fresh(base, tmp_path)
  os.remove(newest + MANIFEST)
  ckpt = _state(0.0)
  assert CheckpointManager(ckpt, d).restore_or_initialize() == newest
  assert np.all(ckpt.v.numpy() == 2.0)


@pytest.mark.parametrize("kind", ["torn manifest", "flipped byte"])
def test_a_newest_whose_manifest_does_not_parse_is_set_aside(base, tmp_path, kind, caplog):
  """Only tfdp writes a manifest, atomically: one that does not parse is damaged, and so is its commit."""
  d, newest = _fresh(base, tmp_path)
  if kind == "torn manifest":
    with open(newest + MANIFEST, "w") as f:
      f.write('{"prefix": "ckpt-2", "fil')
  else:
    _flip(newest + MANIFEST, os.path.getsize(newest + MANIFEST) // 2)
  ckpt = _state(0.0)
  with caplog.at_level(logging.WARNING):
    assert CheckpointManager(ckpt, d).restore_or_initialize() == os.path.join(d, "ckpt-1")
  assert np.all(ckpt.v.numpy() == 1.0)
  assert "not a readable manifest" in caplog.text
  assert os.path.exists(newest + MANIFEST + ".corrupt")


def test_every_checkpoint_broken_initializes(base, tmp_path):
  d, newest = _fresh(base, tmp_path)
  os.remove(newest + DATA)
  os.truncate(os.path.join(d, "ckpt-1") + DATA, 10)
  calls = []
  mgr = CheckpointManager(_state(0.0), d, init_fn=lambda: calls.append(1))
  assert mgr.restore_or_initialize() is None and calls == [1]
  assert mgr.latest_checkpoint is None
  with pytest.raises(errors.CheckpointError, match="No committed checkpoint"):
    mgr.restore()


def test_tfdp_ckpt_ls_says_a_checkpoint_was_set_aside(base, tmp_path):
  d, newest = _fresh(base, tmp_path)
  _flip(newest + DATA)
  assert CheckpointManager(_state(0.0), d).restore_or_initialize() == os.path.join(d, "ckpt-1")
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  buf = io.StringIO()  # In this process: `tfdp-ckpt ls` would start TF again.
  assert ckpt.main(["ls", d], out=buf) == 0, buf.getvalue()
  out = buf.getvalue()
  assert re.search(r"ckpt-2 .*set aside as corrupt \(ckpt-2\.manifest\.json\.corrupt\)", out), out
  assert re.search(r"ckpt-1 .*sizes ok", out), out


def test_a_transient_read_error_is_retried_before_the_checkpoint_is_given_up(base, tmp_path,
                                                                            monkeypatch):
  """An error that proves no damage (storage unavailable a moment) is read again, not condemned."""
  from tfdp.checkpoint import restore as restore_lib  # pylint: disable=g-import-not-at-top
  d, newest = _fresh(base, tmp_path)
  real, calls = restore_lib.restore_verified, []

  def flaky(checkpoint, prefix, man):
    calls.append(prefix)
    if len(calls) == 1:
      raise tf.errors.UnavailableError(None, None, "the storage did not answer")
    return real(checkpoint, prefix, man)

  monkeypatch.setattr(restore_lib, "restore_verified", flaky)
  monkeypatch.setattr(restore_lib, "READ_RETRIES", (0.0, 0.0))
  ckpt = _state(0.0)
  assert CheckpointManager(ckpt, d).restore_or_initialize() == newest
  assert calls == [newest, newest]
  assert np.all(ckpt.v.numpy() == 2.0)
  assert os.path.exists(newest + MANIFEST)
