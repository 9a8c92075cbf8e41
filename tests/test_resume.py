"""Bitwise exact resume of tfdp-train: 2 real workers killed by SIGKILL, SIGTERM, Ctrl-C, then rerun."""

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, WORKERS, launch_workers

TRAIN = [sys.executable, "-m", "tfdp.cli.train"]
# The same program, slowed down from step TFDP_TEST_SLOW_FROM on so that a
# test can interrupt it between two checkpoints.
SLOWABLE = [sys.executable, os.path.join(WORKERS, "resume_train.py")]
FLAGS = ["--model=cnn", "--dataset=synthetic", "--global_batch_size=16",
         "--num_examples=256", "--steps_per_epoch=8", "--seed=1",
         "--deterministic", "--train_steps=60", "--checkpoint_every_steps=10",
         "--preemption_grace_seconds=20"]
MULTI_WORKER = FLAGS + ["--strategy=multi_worker"]
FINAL = "ckpt-60"


def committed_steps(model_dir):
  """Steps of the committed checkpoints in `model_dir`."""
  if not os.path.isdir(model_dir):
    return []
  return sorted(int(f[len("ckpt-"):-len(".manifest.json")])
                for f in os.listdir(model_dir)
                if f.startswith("ckpt-") and f.endswith(".manifest.json"))


def reference_run(tmp_path_factory):
  """The uninterrupted 2-worker run to step 60, made once per pytest session."""
  root = tmp_path_factory.getbasetemp() / "resume_reference"
  root.mkdir(exist_ok=True)
  model_dir = str(root / "model")
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if 60 not in committed_steps(model_dir):
      shutil.rmtree(model_dir, ignore_errors=True)
      code, out = launch_workers(SLOWABLE + MULTI_WORKER + [f"--model_dir={model_dir}"])
      assert code == 0, out[-5000:]
  return os.path.join(model_dir, FINAL)


def assert_bitwise_equal(path_a, path_b):
  """Every model and optimizer tensor of two checkpoints is bitwise equal."""
  a, b = tf.train.load_checkpoint(path_a), tf.train.load_checkpoint(path_b)
  keys = sorted(k for k in a.get_variable_to_shape_map()
                if k.startswith(("model/", "optimizer/")))
  assert keys == sorted(k for k in b.get_variable_to_shape_map()
                        if k.startswith(("model/", "optimizer/")))
  assert any("seed_generator_state" in k for k in keys)  # dropout's RNG
  assert any("momentum" in k for k in keys)  # the optimizer's slots
  assert a.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == 60
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
  env = dict(os.environ, TFDP_TEST_SLOW_FROM=str(after_step),
             TFDP_TEST_STEP_SLEEP="0.4", TF_CPP_MIN_LOG_LEVEL="2")
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
  """Runs the same command again, to completion."""
  code, out = launch_workers(SLOWABLE + MULTI_WORKER + [f"--model_dir={model_dir}"])
  assert code == 0, out[-5000:]
  assert "Restored" in out, out[-5000:]
  return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return reference_run(tmp_path_factory)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """A run SIGKILLed past step 20 (a copy of its state kept), then resumed."""
  root = tmp_path_factory.mktemp("sigkill")
  model_dir = str(root / "model")
  code, out = interrupt(model_dir, "sigkill_worker")
  steps = committed_steps(model_dir)
  snapshot = str(root / "at_kill")
  shutil.copytree(model_dir, snapshot)
  resumed = resume(model_dir)
  return model_dir, code, out, steps, snapshot, resumed


def test_sigkill_then_rerun_is_bitwise_equal(reference, killed):
  model_dir, code, out, steps, _, resumed = killed
  assert code != 0, out[-3000:]
  assert "worker 1 was killed by SIGKILL" in out, out[-3000:]
  assert max(steps) >= 20 and 60 not in steps, steps
  assert f"at step {max(steps)}" in resumed
  assert_bitwise_equal(reference, os.path.join(model_dir, FINAL))


def test_two_worker_checkpoint_resumed_on_one_worker_with_two_replicas(
    reference, killed, tmp_path):
  _, _, _, _, snapshot, _ = killed
  model_dir = str(tmp_path / "model")
  os.makedirs(model_dir)
  for f in os.listdir(snapshot):
    if f.startswith("ckpt-20."):
      shutil.copy(os.path.join(snapshot, f), model_dir)
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  proc = subprocess.run(
      TRAIN + FLAGS + ["--strategy=mirrored", "--cpu_replicas=2",
                       f"--model_dir={model_dir}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      timeout=300, check=False)
  out = proc.stdout.decode("utf-8", errors="replace")
  assert proc.returncode == 0, out[-5000:]
  assert "at step 20" in out
  assert_bitwise_equal(reference, os.path.join(model_dir, FINAL))
