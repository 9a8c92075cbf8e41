"""The tfdp-train runs that test_resume, test_preemption and test_train_cli share: one 2-worker reference, one SIGKILL."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from tests import shared
from tests.conftest import REPO, WORKERS, launch_workers, run_all

TRAIN = [sys.executable, "-m", "tfdp.cli.train"]
# The same program, slowed down from step TFDP_TEST_SLOW_FROM on so that a
# test can interrupt it between two checkpoints.
SLOWABLE = [sys.executable, os.path.join(WORKERS, "resume_train.py")]
TRAIN_STEPS = 60
STEPS_PER_EPOCH = 8
FLAGS = ["--model=cnn", "--dataset=synthetic", "--global_batch_size=16",
         "--num_examples=256", f"--steps_per_epoch={STEPS_PER_EPOCH}", "--seed=1",
         "--deterministic", f"--train_steps={TRAIN_STEPS}", "--checkpoint_every_steps=10",
         "--preemption_grace_seconds=20"]
MULTI_WORKER = FLAGS + ["--strategy=multi_worker"]
FINAL = f"ckpt-{TRAIN_STEPS}"


def committed_steps(model_dir):
  """Steps of the committed checkpoints in `model_dir`."""
  if not os.path.isdir(model_dir):
    return []
  return sorted(int(f[len("ckpt-"):-len(".manifest.json")])
                for f in os.listdir(model_dir)
                if f.startswith("ckpt-") and f.endswith(".manifest.json"))


def _mirrored(flags, model_dir=None):
  """tfdp-train FLAGS on 1 worker with 2 replicas: (code, output)."""
  env = shared.environ()
  env.pop("TF_CONFIG", None)
  proc = subprocess.run(
      TRAIN + flags + ["--strategy=mirrored", "--cpu_replicas=2"]
      + ([f"--model_dir={model_dir}"] if model_dir else []),
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      timeout=300, check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


def shared_runs(root):
  """Every run of the tests that share these flags, in folder `root`, two at a time.

  The `resume_runs` fixture of tests/conftest.py (made once per session).

  First the uninterrupted 2-worker reference beside a 2-worker run that is
  SIGKILLed past step 20 (a copy of its model_dir kept); then that run
  resumed on 2 workers, beside its checkpoint 20 resumed on 1 worker with
  2 replicas, and beside an 8-step run on 1 worker with 2 replicas.

  Returns:
    {"reference": {"model_dir", "final" (its last checkpoint), "code", "out"},
     "killed": {"model_dir", "code", "out" (of the killed run), "steps"
       (committed at the kill), "snapshot" (the copy), "resumed_code" and
       "resumed" (the rerun's exit code and output)},
     "one_worker": {"model_dir", "code", "out"}, "mirrored_8_steps": {"code", "out"}}.
  """
  ref_dir, killed_dir, one_dir = (str(root / d) for d in ("reference", "killed", "one_worker"))

  def reference():
    code, out = launch_workers(SLOWABLE + MULTI_WORKER + [f"--model_dir={ref_dir}"])
    return {"model_dir": ref_dir, "final": os.path.join(ref_dir, FINAL), "code": code,
            "out": out}

  def killed():
    code, out = interrupt(killed_dir, "sigkill_worker")
    snapshot = str(root / "at_kill")
    shutil.copytree(killed_dir, snapshot)
    return {"model_dir": killed_dir, "code": code, "out": out,
            "steps": committed_steps(killed_dir), "snapshot": snapshot}

  def one_worker():
    os.makedirs(one_dir)
    for f in os.listdir(runs["killed"]["snapshot"]):
      if f.startswith("ckpt-20."):
        shutil.copy(os.path.join(runs["killed"]["snapshot"], f), one_dir)
    code, out = _mirrored(FLAGS, one_dir)
    return {"model_dir": one_dir, "code": code, "out": out}

  def mirrored_8_steps():
    code, out = _mirrored([f for f in FLAGS if not f.startswith(
        ("--train_steps", "--checkpoint_every_steps"))] + ["--train_steps=8"])
    return {"code": code, "out": out}

  def rerun():
    return launch_workers(SLOWABLE + MULTI_WORKER + [f"--model_dir={killed_dir}"])

  runs = dict(zip(["reference", "killed"], run_all([reference, killed])))
  resumed, runs["one_worker"], runs["mirrored_8_steps"] = run_all(
      [rerun, one_worker, mirrored_8_steps])
  runs["killed"]["resumed_code"], runs["killed"]["resumed"] = resumed
  return runs


def reference_of(runs):
  """The reference run of `shared_runs` (the `resume_runs` fixture), asserted to have succeeded."""
  ref = runs["reference"]
  assert ref["code"] == 0, ref["out"][-5000:]
  return ref


def assert_bitwise_equal(path_a, path_b):
  """Every model and optimizer tensor of two checkpoints is bitwise equal."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  a, b = tf.train.load_checkpoint(path_a), tf.train.load_checkpoint(path_b)
  keys = sorted(k for k in a.get_variable_to_shape_map()
                if k.startswith(("model/", "optimizer/")))
  assert keys == sorted(k for k in b.get_variable_to_shape_map()
                        if k.startswith(("model/", "optimizer/")))
  assert any("seed_generator_state" in k for k in keys)  # dropout's RNG
  assert any("momentum" in k for k in keys)  # the optimizer's slots
  assert a.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == TRAIN_STEPS
  differ = [k for k in keys
            if np.asarray(a.get_tensor(k)).tobytes() != np.asarray(b.get_tensor(k)).tobytes()]
  assert not differ, f"not bitwise equal: {differ}"


def _children(pid):
  with open(f"/proc/{pid}/task/{pid}/children") as f:
    return [int(p) for p in f.read().split()]


def interrupt(model_dir, how, *, after_step=20, grace_seconds=10, flags=()):
  """Starts a 2-worker run, interrupts it past checkpoint `after_step`, returns (code, output).

  how: "sigkill_worker" (SIGKILL to worker 1), "sigterm_worker" (SIGTERM to
  worker 1 only), "sigterm" or "sigint" (to the launcher, which forwards it
  to every worker, like Ctrl-C in a terminal), or `fn(launcher, worker_pids,
  log_path)` that does the interrupting.
  """
  env = shared.environ(TFDP_TEST_SLOW_FROM=str(after_step), TFDP_TEST_STEP_SLEEP="0.4",
                       TF_CPP_MIN_LOG_LEVEL="2")
  log_path = model_dir + ".log"
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdp.launch", "--num_workers=2",
         f"--grace_seconds={grace_seconds}", "--"] + SLOWABLE + MULTI_WORKER +
        [f"--model_dir={model_dir}"] + list(flags),
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + 240
      while not any(s >= after_step for s in committed_steps(model_dir)):
        assert proc.poll() is None, open(log_path).read()[-5000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)
      time.sleep(1.0)  # a few (slowed) steps past the checkpoint
      if callable(how):
        how(proc, _children(proc.pid), log_path)
      elif how in ("sigkill_worker", "sigterm_worker"):
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL if how == "sigkill_worker" else signal.SIGTERM)
      else:
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
      code = proc.wait(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
  with open(log_path, encoding="utf-8", errors="replace") as f:
    return code, f.read()


def resume(model_dir):
  """Runs the same command again, to completion; returns its output."""
  code, out = launch_workers(SLOWABLE + MULTI_WORKER + [f"--model_dir={model_dir}"])
  assert code == 0, out[-5000:]
  assert "Restored" in out, out[-5000:]
  return out
