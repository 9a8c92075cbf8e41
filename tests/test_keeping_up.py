"""A replaced host recovers at most one interval behind the last local save: every worker writes every save due."""

import threading
import time

import pytest

from tests.workers import local_faults
from tests import tier_runs
from tfdp.checkpoint.local import copies


@pytest.fixture
def linked(tmp_path):
  """The local tiers of a 2-worker job joined by real side channels (tier_runs.linked_tiers)."""
  with tier_runs.linked(str(tmp_path / "linked")) as tiers:
    yield tiers


def test_writers_slower_than_the_saves_still_complete_each_step_everywhere(linked, monkeypatch):
  """Each worker's writer takes longer than the steps between saves, each at its own pace.

  Skipping the saves that came while one was written (each worker its own)
  left few steps written by both, and the step complete everywhere (what a
  replaced host recovers) lagged several intervals behind (the issue: step
  14 for a kill at 27). A save now waits for the one being written, so each
  step is complete on every worker at most one save later.
  """
  tiers = linked
  pace = {0: 0.02, 1: 0.05}  # Seconds each worker's writer takes per copy.
  monkeypatch.setattr(copies, "write", local_faults.before_each_copy(
      lambda worker: time.sleep(pace[worker])))
  lags, every = [], tier_runs.LOCAL_EVERY
  for step in range(every, 41, every):
    # Both workers save at the same step, as training does (each from its own thread).
    threads = [threading.Thread(target=tier_runs.save_local, args=(t, step), kwargs={"wait": False})
               for t in tiers]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    time.sleep(0.005)  # A step of training.
    lags.append(step - (tiers[0].generations.floor or 0))
  for tier in tiers:
    tier.wait()
  # The save being written and the one before: at most 2 intervals behind the
  # save due, one behind the last one written.
  assert max(lags[3:]) <= 2 * every, lags
  assert [t.skipped for t in tiers] == [0, 0]
  assert [sorted(h.step for h in t.held())[-1] for t in tiers] == [40, 40]
