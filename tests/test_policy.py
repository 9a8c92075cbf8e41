"""Save and keep decisions: small pure policies, tested without processes or files."""

import pytest

from tfdp import errors
from tfdp.checkpoint.schedule import policy as p
from tfdp.checkpoint.persistent import retention as r


def _ctx(step, previous=None, last=None, **when):
  return p.SaveContext(step=step, previous_step=previous, last_saved_step=last, **when)


def test_every_n_steps_sees_a_multiple_reached_or_crossed():
  every = p.EveryNSteps(10)
  assert every.should_save(_ctx(10, previous=9))
  assert not every.should_save(_ctx(11, previous=10))
  assert every.should_save(_ctx(12, previous=8))  # steps_per_execution=4 jumped over 10
  assert not every.should_save(_ctx(19, previous=12))
  assert every.should_save(_ctx(20)) and not every.should_save(_ctx(21))
  for bad in (0, -1, True, 2.5):
    with pytest.raises(errors.ConfigError):
      p.EveryNSteps(bad)


def test_min_interval_is_tf_checkpoint_interval():
  interval = p.MinInterval(5)
  assert interval.should_save(_ctx(3))  # nothing saved yet
  assert not interval.should_save(_ctx(9, last=5))
  assert interval.should_save(_ctx(10, last=5))


def test_epoch_end_train_end_preemption():
  assert p.EveryEpoch().should_save(_ctx(7, epoch_end=True))
  assert not p.EveryEpoch().should_save(_ctx(7))
  assert p.AtTrainEnd().should_save(_ctx(7, train_end=True))
  assert not p.AtTrainEnd().should_save(_ctx(7, epoch_end=True))
  assert p.OnPreemption().should_save(_ctx(7, preempted=True))
  assert not p.OnPreemption().should_save(_ctx(7))


def test_any_of_never_saves_twice_at_one_step():
  both = p.AnyOf((p.EveryEpoch(), p.EveryNSteps(5)))
  assert both.should_save(_ctx(5, previous=4))
  assert both.should_save(_ctx(7, epoch_end=True))
  assert not both.should_save(_ctx(5, previous=4, last=5, epoch_end=True))
  assert not p.AnyOf(()).should_save(_ctx(5, epoch_end=True, train_end=True))


def test_from_save_freq_is_keras_save_freq():
  epoch = p.from_save_freq("epoch")
  assert epoch.should_save(_ctx(3, epoch_end=True)) and not epoch.should_save(_ctx(5, previous=4))
  steps = p.from_save_freq(5)
  assert steps.should_save(_ctx(5, previous=4)) and not steps.should_save(_ctx(3, epoch_end=True))
  assert steps.should_save(_ctx(3, preempted=True))
  for bad in ("batch", None, 0, True):
    with pytest.raises(ValueError, match="save_freq"):
      p.from_save_freq(bad)


def _entries(*numbers, metrics=None):
  return [r.Entry(f"ckpt-{n}", n, 3600.0 * n, (metrics or {}).get(n, {})) for n in numbers]


def test_keep_latest_best_and_any_of():
  entries = _entries(1, 2, 3, 4, metrics={1: {"loss": 0.1}, 2: {"loss": 0.5}, 3: {"loss": 0.3}})
  assert r.KeepLatest(2).keeps(entries) == {"ckpt-3", "ckpt-4"}
  assert r.KeepLatest(None).keeps(entries) == {"ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"}
  assert r.KeepBest("loss", "min", 1).keeps(entries) == {"ckpt-1"}
  assert r.KeepBest("loss", "max", 2).keeps(entries) == {"ckpt-2", "ckpt-3"}
  assert r.AnyOf((r.KeepLatest(1), r.KeepBest("loss", "min", 1))).keeps(entries) == {
      "ckpt-1", "ckpt-4"}
  assert r.parse_keep_best(("loss", "min", 2)) == r.KeepBest("loss", "min", 2)
  for bad in (("loss", "up", 1), ("loss", "min", 0), "loss"):
    with pytest.raises(errors.ConfigError):
      r.parse_keep_best(bad)
  with pytest.raises(errors.ConfigError):
    r.KeepLatest(0)


def test_sweep_keeps_the_newest_and_preserves_by_hours_like_tf():
  entries = _entries(1, 2, 3, 4, 5)  # one an hour
  out = r.sweep(entries, r.KeepLatest(1), r.KeepEveryNHours(2), last_preserved=0.0)
  assert [e.number for e in out.kept] == [5]
  # TF preserves a checkpoint leaving the managed set once it is `hours`
  # newer than the last preserved one (not the first one forever).
  assert [e.number for e in out.preserved] == [2, 4]
  assert [e.number for e in out.deleted] == [1, 3]
  assert out.last_preserved == 4 * 3600.0
  none = r.sweep(entries, r.KeepLatest(1), r.KeepEveryNHours(None), 0.0)
  assert [e.number for e in none.deleted] == [1, 2, 3, 4]
  assert r.sweep([], r.KeepLatest(1), r.KeepEveryNHours(None), 7.0).last_preserved == 7.0
