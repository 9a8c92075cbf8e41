"""The 2-worker plain-fit jobs that the local tier's tests share: a replaced host 5 times under attack, and a fallback.

Both run tests/workers/ft_fit.py (data_resume.py's TFRecord pipeline, DATA
sharding, dropout) under tfdp-launch --max_restarts, with local saves
every 2 steps; each is made once per session (tests/shared.py) and several
tests assert on it.
"""

import contextlib
import json
import os
import re
import subprocess
import sys

import numpy as np

from tests import shared
from tests.conftest import REPO, WORKERS
from tests.shared import shared_run

FT_FIT = os.path.join(WORKERS, "ft_fit.py")
LOCAL_EVERY = 2
# Worker 1 loses its host (its local tier wiped, SIGKILL) at these steps, one
# per attempt; worker 0 mounts the attacks at step 3 of the first.
REPLACED_AT = (9, 15, 21, 27, 33)
ATTACK_AT = 3


def _run(root, plan, restarts, **env):
  """tfdp-launch --max_restarts=`restarts` of ft_fit.py under `plan`: {"root", "code", "out"}."""
  env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2", FT_PLAN=json.dumps(plan),
                       FT_LOCAL_EVERY=str(LOCAL_EVERY), **env)
  env.pop("TF_CONFIG", None)
  proc = subprocess.run(
      [sys.executable, "-m", "tfdp.launch", "--num_workers=2", f"--max_restarts={restarts}",
       "--grace_seconds=5", "--", sys.executable, FT_FIT, str(root)],
      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
      check=False)
  return {"root": str(root), "code": proc.returncode,
          "out": proc.stdout.decode("utf-8", errors="replace")}


@shared_run("replaced_host_job")
def replaced_host_job(root):
  """Worker 1's host replaced 5 times (persistent saves every 100 steps: none); a stranger attacks first."""
  plan = {str(a): {"worker": 1, "step": s, "wipe": "own"} for a, s in enumerate(REPLACED_AT)}
  plan["0"]["attack"] = ATTACK_AT
  return _run(root, plan, len(REPLACED_AT), FT_SAVE_FREQ="100")


@shared_run("fallback_job")
def fallback_job(root):
  """Op determinism off; persistent saves every 10 steps.

  Attempt 0: worker 1's host replaced at step 27. Attempt 1: the peer
  recovery of it, with worker 0 (the holder) SIGKILLed in every transfer
  it sends. Attempt 2: the persistent tier, with a transient read error of
  ckpt-20 on worker 1 only; worker 1 SIGKILLed (its tier kept) right after
  the local save of step 25, which attempt 0 had saved too.
  Attempt 3: each worker's own local copy, to the end.
  """
  plan = {"0": {"worker": 1, "step": 27, "wipe": "own"},
          "2": {"read_error": 1, "ckpt": 20, "worker": 1, "step": 25}}
  # One restart more than it needs: a crash loop would use it and fail the
  # test on its count, not on a launcher giving up.
  return _run(root, plan, 4, FT_SAVE_FREQ="10", FT_HOLDER_KILL_FROM="1", FT_NONDETERMINISTIC="1")


def lines(out, pattern):
  """The `ft_fit:` lines of the job's output matching `pattern`, as match objects."""
  return [m for m in (re.search(pattern, l) for l in out.splitlines() if "ft_fit:" in l) if m]


def weights(root, worker):
  return np.load(os.path.join(root, "data", f"weights-{worker}.npy"))


def linked_tiers(root, secret=None):
  """The local tiers of worker 0 and 1 of a 2-worker job, in this process, joined by real side channels.

  What LocalTier.connect agrees on over the collectives (the secret, the
  ports) is given here instead. Returns (tiers, secret).
  """
  from tfdp import cluster  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import layout as layout_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.local import tier as local_lib  # pylint: disable=g-import-not-at-top
  secret = secret or os.urandom(32)
  addresses = ("localhost:1", "localhost:2")
  tiers = []
  for w in (0, 1):
    me = cluster.Worker(w, 2, address=addresses[w], addresses=addresses)
    tier = local_lib.LocalTier(layout_lib.Layout(os.path.join(root, f"worker-{w}"), "ckpt"),
                               me, LOCAL_EVERY, 60)
    tier.start("token", "session")
    tier.link = tier.make_link(secret)
    tiers.append(tier)
  for tier in tiers:
    tier.link.start([("localhost", t.link.port) for t in tiers])
  return tiers, secret


@contextlib.contextmanager
def linked(root):
  """`linked_tiers(root)`'s tiers, closed when the block ends (a fixture's body)."""
  tiers, _ = linked_tiers(root)
  try:
    yield tiers
  finally:
    for tier in tiers:
      tier.close()


def save_local(tier, step, position=b"position", wait=True):
  """A local save of a tiny state and `tier`'s per-worker data position at `step`; waits for it (with `wait`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import layout as layout_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import planner  # pylint: disable=g-import-not-at-top
  items = [planner.Item("v", "", tf.constant([float(step)] * 4), 16),
           planner.Item(layout_lib.per_worker_prefix(tier.worker) + "data", "",
                        tf.constant(position), 0)]
  meta = manifest_lib.SaveMeta(step, step, per_worker_keys=["data"], tier="local",
                               run_token=tier.token)
  tier.save(step, lambda: items, lambda: meta)
  if wait:
    tier.wait()
