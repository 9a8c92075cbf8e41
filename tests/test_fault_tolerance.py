"""Fault tolerance with real tfdp-train workers: a survivor's bounded exit, and a seeded SIGKILL chaos run."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tfdp import errors
from tfdp.liveness import heartbeat
from tfdp import launch
from tests import save_faults
from tests import shared
from tests.conftest import REPO
from tests.workers import ft_common


@pytest.mark.slow
def test_a_survivor_exits_within_the_bound_naming_the_lost_peer(tmp_path):
  out = open(tmp_path / "log.txt", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
  cmd = ft_common.command(str(tmp_path / "model"))
  cmd = [c.replace(f"--train_steps={ft_common.STEPS}", "--train_steps=100000")
         for c in cmd]
  group = launch.Launcher(cmd, 2, env=ft_common.env(), out=out, grace_seconds=5)
  try:
    group.start()
    deadline = time.monotonic() + 240
    # Both train once both beat (the second worker's first beat needs a step).
    while not all(os.path.exists(f) for f in group.heartbeat_files):
      assert time.monotonic() < deadline, "the workers did not start training"
      assert all(p.poll() is None for p in group.procs), "a worker ended early"
      time.sleep(0.1)
    time.sleep(1.0)
    victim = group.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    survivor = group.procs[0]
    try:
      code = survivor.wait(timeout=heartbeat.PEER_LOSS_BOUND_SECONDS)
    finally:
      took = time.monotonic() - killed
  finally:
    group.stop(grace_seconds=0)
    group.cleanup()
  for pump in group._pumps:  # pylint: disable=protected-access
    pump.join(timeout=5)
  out.seek(0)
  text = out.read()
  peer = group.cluster["worker"][1]
  assert code == heartbeat.EXIT_PEER_LOST, text[-3000:]
  assert took <= heartbeat.PEER_LOSS_BOUND_SECONDS
  assert f"lost peer worker 1 ({peer})" in text, text[-3000:]


def _plan(seed):
  """5 SIGKILLs: 3 at random steps, 2 inside checkpoint saves, each of a random worker.

  The second step kill is of worker 1, which first deletes its local tier (a
  replaced host): the restart recovers the newest local step from worker 0.
  """
  rng = random.Random(seed)
  steps = sorted(rng.sample(range(10, ft_common.TEST_STEPS - 10), 3))
  phases = rng.sample(save_faults.PHASES, 2)
  events = [{"step": s} for s in steps] + [{"phase": p} for p in phases]
  rng.shuffle(events)
  # A step kill only fires past the restored step: keep step kills increasing.
  step_events = iter(sorted(e["step"] for e in events if "step" in e))
  for e in events:
    if "step" in e:
      e["step"] = next(step_events)
    e["worker"] = rng.randrange(2)
  replaced = [e for e in events if "step" in e][1]
  replaced.update(worker=1, wipe="own")
  return {str(i): e for i, e in enumerate(events)}


# The chaos run's tiers (of ft_common.TEST_STEPS = 100 steps): local saves
# every step, persistent every 50.
TIERS = ["--checkpoint_every_steps=50", "--local_checkpoint_every_steps=1"]


def recomputed_from_records(folder, attempts, final_step):
  """Steps run again, from what ft_train's workers recorded (FT_REACHED_DIR), not from tfdp.

  Attempt b ran again the steps after the one it restored, up to the
  furthest an earlier attempt reached (both workers' records, the maximum).
  Returns (total, [(restored, reached) of each attempt]).
  """
  seen = []
  for attempt in range(attempts):
    restored, reached = None, None
    for worker in (0, 1):
      try:
        with open(os.path.join(folder, f"{attempt}-{worker}"), encoding="utf-8") as f:
          record = f.read().split()
      except FileNotFoundError:
        record = []
      if not record:  # died before its first step ended
        continue
      r, s = (int(x) for x in record)
      restored = r if restored is None else min(restored, r)
      reached = s if reached is None else max(reached, s)
    seen.append((restored, reached))
  assert seen[-1][1] == final_step, seen
  total, furthest = 0, None
  for restored, reached in seen:
    if reached is None:
      continue
    if furthest is not None:
      total += max(0, min(reached, furthest) - restored)
    furthest = reached if furthest is None else max(furthest, reached)
  return total, seen


@pytest.mark.slow
@pytest.mark.usefixtures("ft_reference")  # made early (tests/shared.py)
def test_chaos_sigkill_five_times_loses_few_steps_and_ends_bitwise_equal(tmp_path, tmp_path_factory):
  """Local tier every step, persistent every 50: a SIGKILL costs at most a step on average.

  The same job without the local tier recomputes about half the persistent
  interval per failure (scripts/bench_tiers.py --parts=chaos runs both side
  by side, persistent every 100 of 200 steps).
  """
  reference = ft_common.reference(tmp_path_factory)
  plan = _plan(seed=6)
  model_dir = str(tmp_path / "model")
  flags = TIERS + ft_common.TEST_FLAGS + [f"--local_checkpoint_dir={tmp_path / 'local'}"]
  code, out = ft_common.run_job(
      model_dir, str(tmp_path / "log.txt"), flags,
      env=ft_common.env(FT_CHAOS_PLAN=json.dumps(plan), FT_REACHED_DIR=str(tmp_path / "reached")),
      max_restarts=5, hang_timeout=60)
  assert code == 0, out[-5000:]
  restarts = [l for l in out.splitlines() if "[tfdp-launch] restart " in l]
  assert len(restarts) == 5, (plan, restarts)
  assert all("was killed by SIGKILL" in l for l in restarts), restarts
  assert "job finished after 5 restart(s)" in out
  # The replaced host got the newest local step from its peer.
  assert re.search(r"recovered step \d+ from worker 0 over the side channel", out), out[-5000:]
  line = next(l for l in out.splitlines() if "[tfdp-launch] goodput " in l)
  print(line)
  recomputed = int(re.search(r"(\d+) steps? recomputed", line).group(1))
  # Exact: the steps the killed attempts reached, as the workers recorded them.
  truth, seen = recomputed_from_records(tmp_path / "reached", 6, ft_common.TEST_STEPS)
  assert recomputed == truth, (line, seen)
  assert recomputed / 5 <= 1, (line, seen)
  summary = json.loads((tmp_path / "model" / "goodput.json").read_text())
  assert summary["restarts"] == 5 and summary["recomputed_steps"] == recomputed
  assert summary["local_every_steps"] == 1, summary
  # Every attempt that got as far as restoring took a local copy, its own or a peer's.
  tiers = {a["restored_tier"] for a in summary["attempts"][1:] if a["has_record"]}
  assert tiers <= {"local", "peer"} and "peer" in tiers, summary["attempts"]
  assert list((tmp_path / "model" / "logs" / "goodput").glob("events.out.tfevents.*"))
  # The completed run leaves no local copies behind.
  assert not any(files for _, _, files in os.walk(tmp_path / "local")), list(os.walk(tmp_path / "local"))
  prefixes, problems = ft_common.verify_all(model_dir)
  assert os.path.join(model_dir, f"ckpt-{ft_common.TEST_STEPS}") in prefixes
  assert not problems, problems
  diffs = ft_common.differences(ft_common.final_weights(reference),
                                ft_common.final_weights(model_dir))
  assert not diffs, f"plan {plan}: weights differ from the uninterrupted run: {diffs}"


def _slurm_env(monkeypatch, procid, port):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  for k, v in {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "3",
               "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1",
               "TFDP_PORT": str(port)}.items():
    monkeypatch.setenv(k, v)


def test_a_slurm_step_resolves_to_a_cluster_without_tf_config(monkeypatch):
  from tfdp.distribute import environment  # pylint: disable=g-import-not-at-top
  _slurm_env(monkeypatch, 2, 9100)
  resolver, config = environment.resolve_cluster("auto")
  assert resolver is not None
  assert config == {"cluster": {"worker": ["node1:9100", "node1:9101", "node2:9100"]},
                    "task": {"type": "worker", "index": 2}}
  assert environment.num_cluster_workers(config) == 3
  # TF_CONFIG wins under auto; an explicit choice is honoured.
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}))
  assert environment.resolve_cluster("auto")[0] is None
  assert environment.resolve_cluster("slurm")[1]["task"]["index"] == 2
  monkeypatch.delenv("SLURM_PROCID")
  monkeypatch.delenv("TF_CONFIG")
  assert environment.resolve_cluster("auto") == (None, None)
  with pytest.raises(errors.ConfigError, match="needs a SLURM job step"):
    environment.resolve_cluster("slurm")
  with pytest.raises(errors.ConfigError, match="Unknown cluster 'k8s'"):
    environment.resolve_cluster("k8s")


def test_heartbeat_callback_writes_the_step_and_is_a_no_op_without_a_file(tmp_path, monkeypatch):
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
  path = tmp_path / "beat"
  x, y = np.zeros((8, 2), np.float32), np.zeros((8, 1), np.float32)
  model.fit(x, y, batch_size=2, epochs=1, verbose=0,
            callbacks=[heartbeat.Heartbeat(str(path), min_interval=0)])
  assert path.read_text().split()[0] == "4"
  monkeypatch.delenv(heartbeat.ENV_HEARTBEAT_FILE, raising=False)
  beat = heartbeat.Heartbeat()
  assert beat.path is None
  model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[beat])
  # Single-host strategies have no peers to watch.
  assert heartbeat.PeerWatchdog.for_strategy(model.distribute_strategy) is None


def test_lost_peers_are_named_from_tensorflows_messages():
  config = {"cluster": {"worker": ["h0:1", "h1:2", "h2:3"]},
            "task": {"type": "worker", "index": 0}}
  unhealthy = ("Collective ops is aborted by: Error reported from /job:worker/task:1: "
               "The following tasks are unhealthy (stopped sending heartbeats):\n"
               "/job:worker/replica:0/task:1\nThe tasks have crashed.")
  assert heartbeat.lost_peers(unhealthy, config) == ["worker 1 (h1:2)"]
  reset = ("{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/"
           "task:0/device:CPU:0}} Additional GRPC error information from remote target "
           "/job:worker/replica:0/task:2 while calling /tensorflow.WorkerService/RecvBuf")
  assert heartbeat.lost_peers(reset, config) == ["worker 2 (h2:3)"]
  assert heartbeat.lost_peers("no task here", config) == []


def test_a_worker_cut_off_from_the_coordination_leader_names_it(monkeypatch):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": {"worker": ["10.0.0.1:5", "10.0.0.2:6"]}, "task": {"type": "worker", "index": 1}}))
  error = tf.errors.DeadlineExceededError(
      None, None, "Collective ops is aborted by: Deadline Exceeded RPC: "
      "/tensorflow.CoordinationService/Heartbeat The error could be from a previous operation.")
  assert heartbeat.is_peer_loss(error)
  line = heartbeat.describe_peer_loss(error)
  assert line.startswith("lost peer worker 0 (10.0.0.1:5), the coordination service leader: "
                         "aborted by: Deadline Exceeded"), line


_HUNG_PEER_CHECK = r"""
import json, os, socket, sys, threading, time
# Task 1 of a 2-worker cluster accepts TCP connections and never answers,
# like a process that was SIGSTOPped.
silent = socket.socket(); silent.bind(("localhost", 0)); silent.listen(8)
held = []
threading.Thread(target=lambda: [held.append(silent.accept()) for _ in range(64)],
                 daemon=True).start()
free = socket.socket(); free.bind(("localhost", 0)); own = free.getsockname()[1]; free.close()
import tensorflow as tf
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context
from tfdp.liveness import heartbeat
spec = tf.train.ClusterSpec({"worker": [f"localhost:{own}",
                                        f"localhost:{silent.getsockname()[1]}"]})
context.context().enable_collective_ops(tensorflow_server_pb2.ServerDef(
    cluster=spec.as_cluster_def(), job_name="worker", task_index=0, protocol="grpc"))
gaps, stop = [0.0], threading.Event()
def tick():
  last = time.monotonic()
  while not stop.wait(0.01):
    now = time.monotonic(); gaps.append(now - last); last = now
threading.Thread(target=tick, daemon=True).start()
start = time.monotonic()
try:
  heartbeat.check_peer(context.context(), "/job:worker/replica:0/task:1", 3.0)
  error = None
except Exception as e:  # pylint: disable=broad-except
  error = type(e).__name__
stop.set()
print(json.dumps({"error": error, "took": time.monotonic() - start, "gap": max(gaps)}))
sys.stdout.flush()
os._exit(0)  # TF's gRPC server has no clean shutdown
"""


def test_checking_a_hung_peer_leaves_the_other_threads_running():
  # TF's check_collective_ops_peer_health holds the GIL for as long as it
  # waits: one 5-s check of a hung peer froze the preemption grace watchdog
  # past its deadline (a grace of 3 s ended after 6 s, as a lost peer).
  proc = subprocess.run([sys.executable, "-c", _HUNG_PEER_CHECK], cwd=REPO, timeout=120,
                        env=shared.environ(TF_CPP_MIN_LOG_LEVEL="2"),
                        capture_output=True, text=True)
  assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["error"] == "DeadlineExceededError", result
  assert 3.0 <= result["took"] < 5.0, result
  # Other threads wait for about a probe (0.5 s; more on a busy host), not
  # for the whole check (3 s).
  assert result["gap"] < 1.5, result
