"""Recovery from the local tier with real workers: a replaced host 5 times, a holder killed mid-transfer, fallbacks agreed.

Two shared 2-worker plain-fit jobs (tests/tier_runs.py), each under
tfdp-launch --max_restarts with real SIGKILLs and real files; the first
is also attacked on its side channel (tests/test_side_channel.py).
"""

import re

import numpy as np
import pytest

from tests import tier_runs
from tests.tier_runs import fallback_job, replaced_host_job  # pylint: disable=unused-import
from tests.test_fit_data_position import two_worker_reference_runs  # pylint: disable=unused-import

pytestmark = pytest.mark.slow


def _restored(out):
  """{attempt: (restored step or None, tier)} as each worker printed it (both must agree)."""
  seen = {}
  for m in tier_runs.lines(out, r"attempt (\d+) worker (\d): restored (\w+) from the (\w+) tier"):
    step = None if m.group(3) == "None" else int(m.group(3))
    seen.setdefault(int(m.group(1)), set()).add((step, m.group(4)))
  assert all(len(v) == 1 for v in seen.values()), f"the workers restored different states: {seen}"
  return {a: v.pop() for a, v in seen.items()}


def test_a_host_replaced_five_times_recovers_from_the_local_tier_each_time(replaced_host_job,
                                                                           two_worker_reference_runs):
  """Plain fit on TFRecords; worker 1's local tier wiped and SIGKILLed 5 times; no persistent checkpoint.

  Each restart takes a step from the local tier (worker 1's share and its
  data position sent by worker 0) no older than worker 1's last local save
  minus one interval, nor than the newest step complete on every worker at
  the kill, and the run ends bitwise equal to an uninterrupted one.
  """
  job = replaced_host_job
  out = job["out"]
  assert job["code"] == 0, out[-5000:]
  assert "job finished after 5 restart(s)" in out, out[-5000:]
  kills = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in tier_runs.lines(
      out, r"attempt (\d+) worker 1: SIGKILL at step \d+, last local save (\d+) .*"
           r"complete everywhere (\d+), .*wiped own")}
  assert sorted(kills) == [0, 1, 2, 3, 4], out[-5000:]
  restored = _restored(out)
  for attempt, (last, complete) in kills.items():
    step, tier = restored[attempt + 1]
    assert tier == "peer" and max(complete, last - tier_runs.LOCAL_EVERY) <= step <= last, (
        attempt, restored, kills)
  assert len(re.findall(r"recovered step \d+ from worker 0 over the side channel", out)) == 5
  assert re.search(r"\[worker 0\] tfdp: resumed from \S+/ckpt-\d+ \(the peer tier\) at step \d+ "
                   r"\(epoch \d, step \d+ of it; data position restored"
                   r"(, [\d.]+ [KMG]?B per worker)?\)", out), out[-3000:]
  ref = tier_runs.weights(two_worker_reference_runs["root"] + "/ref", 0)
  for worker in (0, 1):
    np.testing.assert_array_equal(ref, tier_runs.weights(job["root"], worker))
  # close() ended every worker's side channel: no listener, no thread.
  assert len(tier_runs.lines(out, r"finished; side-channel threads left: \[\]")) == 2, out[-3000:]


def test_a_holder_killed_in_the_transfer_falls_back_and_never_crash_loops(fallback_job):
  """The holder SIGKILLed in every transfer it sends: one failed attempt, then the persistent tier.

  The restart after the crash deletes the failed step's copies and tries no
  peer recovery; the workers agree on the persistent checkpoint (a transient
  read error of the newest on one worker moves both to the one before),
  and the chief says in one line what was tried and what was restored.
  """
  out = fallback_job["out"]
  assert fallback_job["code"] == 0, out[-5000:]
  assert "job finished after 3 restart(s)" in out, out[-5000:]
  assert len(tier_runs.lines(out, r"attempt 1 worker 0: SIGKILL during a peer transfer")) == 1
  assert len(re.findall(r"a peer recovery of step \d+ did not finish", out)) == 2, out[-5000:]
  restored = _restored(out)
  assert restored[2] == (10, "persistent"), restored  # ckpt-20 failed on worker 1: both to ckpt-10
  assert re.search(r"\[worker 0\] WARNING:absl:tfdp: restore: tried a peer recovery that an earlier "
                   r"attempt did not finish, then persistent ckpt-20 \(failed on worker\(s\) \[1\]\); "
                   r"restored \S+/ckpt-10 \(persistent tier\)", out), out[-5000:]
  assert "[worker 1] WARNING:absl:tfdp: restore: tried" not in out  # the chief's line only


def test_after_a_fallback_a_later_local_restore_leaves_both_workers_identical(fallback_job):
  """Op determinism off: each attempt computes other bits. The fallback deleted what the abandoned
  attempt had saved past it, so the later local restore takes this attempt's copies on both workers."""
  out = fallback_job["out"]
  assert fallback_job["code"] == 0, out[-5000:]
  step, tier = _restored(out)[3]
  assert tier == "local" and step >= 24, _restored(out)
  a, b = (tier_runs.weights(fallback_job["root"], w) for w in (0, 1))
  assert a.tobytes() == b.tobytes(), f"the workers' weights differ by up to {np.max(np.abs(a - b))}"
