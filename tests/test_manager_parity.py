"""Differential tests: the same scenarios against tf.train.CheckpointManager and tfdp.CheckpointManager."""

import inspect
import os
import time

import numpy as np
import pytest
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint.format import layout as layout_lib

KINDS = ["tf", "tfdp"]


def _manager(kind, ckpt, directory, **kw):
  cls = tf.train.CheckpointManager if kind == "tf" else CheckpointManager
  return cls(ckpt, str(directory), **kw)


def _files(directory):
  """Files on disk, less tfdp's own bookkeeping (manifests, lease, temp dir)."""
  return sorted(f for f in os.listdir(directory)
                if not f.endswith(layout_lib.MANIFEST_SUFFIX)
                and f not in (layout_lib.LEASE_FILENAME, layout_lib.TMP_DIRNAME))


def _names(paths):
  return [os.path.basename(p) for p in paths]


def _observed(mgr, directory):
  state = tf.train.get_checkpoint_state(str(directory))
  return {
      "files": _files(directory),
      "checkpoints": _names(mgr.checkpoints),
      "latest": os.path.basename(mgr.latest_checkpoint or ""),
      "state_latest": os.path.basename(state.model_checkpoint_path) if state else None,
      "state_all": _names(state.all_model_checkpoint_paths) if state else None,
      "tf_latest": os.path.basename(tf.train.latest_checkpoint(str(directory)) or ""),
  }


def _both(tmp_path, scenario):
  """Runs `scenario(kind, directory)` for both managers; returns their results."""
  out = {}
  for kind in KINDS:
    d = tmp_path / kind
    d.mkdir()
    out[kind] = scenario(kind, d)
  return out


class Clock:
  """A controlled time.time() for both modules (they share the time module)."""

  def __init__(self, monkeypatch, start=1_000_000.0):
    self.now = start
    monkeypatch.setattr(time, "time", lambda: self.now)


def test_constructor_and_methods_match_tfs():
  theirs = inspect.signature(tf.train.CheckpointManager.__init__).parameters
  ours = inspect.signature(CheckpointManager.__init__).parameters
  assert list(ours)[:len(theirs)] == list(theirs)
  for name, p in theirs.items():
    if name != "max_to_keep":  # A required positional in TF; tfdp defaults to 5.
      assert ours[name].default == p.default, name
  assert ours["max_to_keep"].default == 5
  assert list(inspect.signature(CheckpointManager.save).parameters)[:4] == list(
      inspect.signature(tf.train.CheckpointManager.save).parameters)
  for attr in ("restore_or_initialize", "sync", "checkpoints", "latest_checkpoint",
               "directory", "checkpoint", "checkpoint_interval"):
    assert hasattr(CheckpointManager, attr), attr


@pytest.mark.parametrize("max_to_keep", [2, None])
def test_save_keep_delete_sequence(tmp_path, max_to_keep):
  def scenario(kind, d):
    v = tf.Variable(0.0)
    mgr = _manager(kind, tf.train.Checkpoint(v=v), d, max_to_keep=max_to_keep)
    seen = []
    for i in range(4):
      v.assign(float(i))
      path = mgr.save()
      seen.append((os.path.basename(path), _observed(mgr, d)))
    seen.append(("numbered", os.path.basename(mgr.save(checkpoint_number=10))))
    seen.append(("after", _observed(mgr, d), int(mgr.checkpoint.save_counter.numpy())))
    return seen

  r = _both(tmp_path, scenario)
  assert r["tfdp"] == r["tf"]


def test_hours_retention_with_a_controlled_clock(tmp_path, monkeypatch):
  clock = Clock(monkeypatch)

  def scenario(kind, d):
    clock.now = 1_000_000.0
    mgr = _manager(kind, tf.train.Checkpoint(v=tf.Variable(1.0)), d, max_to_keep=1,
                   keep_checkpoint_every_n_hours=1)
    seen = []
    for _ in range(7):
      clock.now += 2000.0
      mgr.save()
      state = tf.train.get_checkpoint_state(str(d))
      seen.append((_observed(mgr, d), state.last_preserved_timestamp,
                   list(state.all_model_checkpoint_timestamps)))
    again = _manager(kind, tf.train.Checkpoint(v=tf.Variable(0.0)), d, max_to_keep=1,
                     keep_checkpoint_every_n_hours=1)
    seen.append(_names(again.checkpoints))
    return seen

  r = _both(tmp_path, scenario)
  assert r["tfdp"] == r["tf"]
  # The first is not kept forever; the hours-kept are on disk, not listed.
  assert "ckpt-1.index" not in r["tf"][-2][0]["files"]
  assert "ckpt-2.index" in r["tf"][-2][0]["files"]
  assert r["tf"][-2][0]["checkpoints"] == ["ckpt-7"]


def test_interval_after_restore_saves_no_duplicate(tmp_path):
  def scenario(kind, d):
    step = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(step=step)
    mgr = _manager(kind, ckpt, d, max_to_keep=5, step_counter=step, checkpoint_interval=5)
    got = []
    for s in (0, 3, 5, 5, 7):
      step.assign(s)
      got.append(mgr.save())
    step.assign(7)
    got.append(mgr.save(check_interval=False))
    got.append(mgr.save(check_interval=False))  # The same step: skipped either way.
    step2 = tf.Variable(0, dtype=tf.int64)
    mgr2 = _manager(kind, tf.train.Checkpoint(step=step2), d, max_to_keep=5,
                    step_counter=step2, checkpoint_interval=5)
    got.append(os.path.basename(mgr2.restore_or_initialize()))
    got.append(int(step2.numpy()))
    for s in (7, 9, 12):
      step2.assign(s)
      got.append(mgr2.save())
    mgr3 = _manager(kind, tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64)), d,
                    max_to_keep=5, step_counter=step2, checkpoint_interval=5,
                    last_checkpoint_step=12)
    got.append(mgr3.save())
    got.append(mgr.checkpoint_interval)
    return [os.path.basename(g) if isinstance(g, str) and os.sep in g else g for g in got]

  r = _both(tmp_path, scenario)
  assert r["tfdp"] == r["tf"]
  assert r["tf"] == ["ckpt-1", None, "ckpt-2", None, None, "ckpt-3", None,
                     "ckpt-3", 7, None, None, "ckpt-4", None, 5]


def test_init_fn_only_without_a_checkpoint(tmp_path):
  def scenario(kind, d):
    calls = []
    v = tf.Variable(1.0)
    mgr = _manager(kind, tf.train.Checkpoint(v=v), d, max_to_keep=2,
                   init_fn=lambda: calls.append("init"))
    first = mgr.restore_or_initialize()
    mgr.save()
    mgr2 = _manager(kind, tf.train.Checkpoint(v=tf.Variable(0.0)), d, max_to_keep=2,
                    init_fn=lambda: calls.append("init2"))
    second = os.path.basename(mgr2.restore_or_initialize())
    return first, second, calls, float(mgr2.checkpoint.v.numpy())

  r = _both(tmp_path, scenario)
  assert r["tfdp"] == r["tf"] == (None, "ckpt-1", ["init"], 1.0)


def _continue(kind, d):
  """A manager of `kind` picks up what another writer left in `d`."""
  v = tf.Variable(np.zeros(3, np.float32))
  mgr = _manager(kind, tf.train.Checkpoint(v=v), d, max_to_keep=2)
  before = _observed(mgr, d)
  restored = os.path.basename(mgr.restore_or_initialize() or "")
  values = v.numpy().tolist()
  v.assign(v + 1.0)
  saved = os.path.basename(mgr.save())
  return before, restored, values, saved, _observed(mgr, d)


@pytest.mark.parametrize("writer", ["tf.train.Checkpoint.save", "tf.train.CheckpointManager",
                                    "another prefix", "another checkpoint_name"])
def test_continues_a_directory_written_by_tf(tmp_path, writer):
  """Whatever prefix TF wrote: its latest is restored, numbering goes on, retention as TF's."""
  name = "model" if writer in ("another prefix", "another checkpoint_name") else "ckpt"

  def scenario(kind, d):
    v = tf.Variable(np.zeros(3, np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    stock = tf.train.CheckpointManager(ckpt, str(d), max_to_keep=2, checkpoint_name=name)
    for i in range(3):
      v.assign([i, i, i])
      if writer in ("tf.train.Checkpoint.save", "another prefix"):
        ckpt.save(str(d / name))
      else:
        stock.save()
    return _continue(kind, d)

  r = _both(tmp_path, scenario)
  assert r["tfdp"] == r["tf"]
  assert r["tf"][1] == f"{name}-3" and r["tf"][2] == [2.0, 2.0, 2.0]
  assert r["tf"][3] == "ckpt-4"


def test_last_saved_step_and_deprecated_hours_name(tmp_path):
  step = tf.Variable(0, dtype=tf.int64)
  mgr = CheckpointManager(tf.train.Checkpoint(step=step), str(tmp_path), max_to_keep=2)
  assert mgr.last_saved_step is None
  mgr.save(checkpoint_number=7)
  assert mgr.last_saved_step == 7
  with pytest.warns(DeprecationWarning, match="keep_checkpoint_every_n_hours"):
    again = CheckpointManager(tf.train.Checkpoint(step=step), str(tmp_path),
                              max_to_keep=2, keep_every_n_hours=1.0)
  assert again.restore_or_initialize() == str(tmp_path / "ckpt-7")
  assert again.last_saved_step == 7
  callbacks = []
  again.save(checkpoint_number=8,
             options=tf.train.CheckpointOptions(experimental_write_callbacks=[callbacks.append]))
  assert callbacks == [str(tmp_path / "ckpt-8")]


def test_async_save_deletes_in_the_background_documented_difference(tmp_path):
  mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), str(tmp_path),
                          max_to_keep=1, async_save=True)
  for _ in range(3):
    mgr.save()
  mgr.sync()
  assert _files(tmp_path) == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index"]


def test_checkpoints_nothing_names_are_refused_not_silently_restarted_next_to(tmp_path):
  """TF's manager starts over beside checkpoints its state file does not name; tfdp refuses in one line."""
  ckpt = tf.train.Checkpoint(v=tf.Variable(np.full(3, 7.0, np.float32)))
  ckpt.write(str(tmp_path / "model-3"))  # No state file names it.
  fresh = tf.train.Checkpoint(v=tf.Variable(np.zeros(3, np.float32)))
  stock = tf.train.CheckpointManager(fresh, str(tmp_path), max_to_keep=2)
  assert stock.restore_or_initialize() is None  # TF: silently from scratch.
  mgr = CheckpointManager(fresh, str(tmp_path), max_to_keep=2)
  with pytest.raises(errors.CheckpointError, match=r"holds checkpoints \(model-3\)") as e:
    mgr.restore_or_initialize()
  assert "\n" not in str(e.value)
  mgr.restore(str(tmp_path / "model-3"))  # What the message says to do works.
  assert fresh.v.numpy().tolist() == [7.0, 7.0, 7.0]


def test_a_custom_loops_save_of_a_step_already_saved_returns_its_path(tmp_path, caplog):
  """Every N steps plus at the epoch's end: the end's save of the step just saved is not an error.

  TF's manager writes another numbered checkpoint; tfdp's numbers are steps,
  so it returns the checkpoint that holds the step (a debug line says so).
  """
  import logging  # pylint: disable=g-import-not-at-top
  step = tf.Variable(0, dtype=tf.int64)
  v = tf.Variable(0.0)
  ckpt = tf.train.Checkpoint(v=v, step=step)
  mgr = CheckpointManager(ckpt, str(tmp_path), step_counter=step)
  saved = []
  with caplog.at_level(logging.DEBUG, logger="absl"):
    for _ in range(2):  # 2 epochs of 4 steps, a save every 2 steps and at each epoch's end.
      for _ in range(4):
        step.assign_add(1)
        v.assign_add(1.0)
        if int(step) % 2 == 0:
          saved.append(mgr.save(checkpoint_number=int(step)))
      saved.append(mgr.save(checkpoint_number=int(step)))
  assert [os.path.basename(p) for p in saved] == [
      "ckpt-2", "ckpt-4", "ckpt-4", "ckpt-6", "ckpt-8", "ckpt-8"]
  assert "already holds step 4; not saved again" in caplog.text
  assert int(ckpt.save_counter) == 4  # Only the saves that wrote.
  # Another state at that number is still refused (its step differs).
  step.assign_add(1)
  with pytest.raises(errors.CheckpointError, match="already exists"):
    mgr.save(checkpoint_number=8)


def test_without_a_step_counter_a_second_save_at_a_number_is_refused_not_dropped(tmp_path):
  """Nothing tells a repeat of the state from a changed one: refused, never the changed state dropped."""
  v = tf.Variable(1.0)
  ckpt = tf.train.Checkpoint(v=v)
  mgr = CheckpointManager(ckpt, str(tmp_path))
  mgr.save(checkpoint_number=1)
  v.assign(2.0)
  with pytest.raises(errors.CheckpointError, match="already exists.*step_counter"):
    mgr.save(checkpoint_number=1)
