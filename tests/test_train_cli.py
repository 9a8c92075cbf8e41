"""End-to-end tests of tfdp-train: 2 real workers through tfdp-launch, resume, flag errors."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, launch_workers

TRAIN = [sys.executable, "-m", "tfdp.cli.train"]
SMALL = ["--model=cnn", "--dataset=synthetic", "--global_batch_size=32",
         "--num_examples=512", "--steps_per_epoch=8", "--seed=1"]


@pytest.fixture(scope="module")
def two_worker_run(tmp_path_factory):
  """One 2-worker MultiWorkerMirroredStrategy run to step 20, then resumed to 30."""
  model_dir = str(tmp_path_factory.mktemp("mw") / "model")
  first = launch_workers(TRAIN + SMALL + [
      "--strategy=multi_worker", "--train_steps=20", "--checkpoint_every_steps=10",
      f"--model_dir={model_dir}"], num_workers=2, timeout=300)
  ckpt20 = tf.train.latest_checkpoint(model_dir)
  second = launch_workers(TRAIN + SMALL + [
      "--strategy=multi_worker", "--train_steps=30", f"--model_dir={model_dir}"],
                          num_workers=2, timeout=300)
  return model_dir, first, ckpt20, second


def test_two_workers_train_and_leave_a_standard_checkpoint_at_step_20(two_worker_run):
  model_dir, (code, out), ckpt20, _ = two_worker_run
  assert code == 0, out
  assert ckpt20 == os.path.join(model_dir, "ckpt-20"), out
  reader = tf.train.load_checkpoint(ckpt20)
  assert reader.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == 20
  assert reader.get_tensor("model/conv2d/kernel/.ATTRIBUTES/VARIABLE_VALUE").shape == (3, 3, 3, 16)
  # Both workers wrote a part of it.
  assert sorted(f for f in os.listdir(model_dir) if f.startswith("ckpt-20.data")) == [
      "ckpt-20.data-00000-of-00002", "ckpt-20.data-00001-of-00002"]
  # Only the chief prints the progress bar and the final path.
  assert "[worker 0] Epoch 1/" in out and "[worker 1] Epoch" not in out
  assert "Final checkpoint at step 20" in out


def test_rerun_resumes_from_the_checkpoint(two_worker_run):
  model_dir, _, _, (code, out) = two_worker_run
  assert code == 0, out
  assert "Restored" in out and "at step 20" in out
  # Steps 20..23 finish epoch 3 (8 steps each), steps 24..29 are a short epoch 4.
  assert "Epoch 3/3" in out and "Epoch 4/4" in out and "Epoch 1/" not in out
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  assert reader.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == 30


def test_mirrored_run_matches_the_first_losses_of_the_two_worker_run(two_worker_run, tmp_path):
  # 2 workers x 1 replica and 1 worker x 2 replicas see the same global batches.
  _, (_, out), _, _ = two_worker_run
  proc = subprocess.run(TRAIN + SMALL + ["--strategy=mirrored", "--cpu_replicas=2",
                                         "--train_steps=8"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                        timeout=300, check=False)
  mirrored = proc.stdout.decode()
  assert proc.returncode == 0, mirrored

  def first_epoch_loss(text):
    epoch1 = text.split("Epoch 2/", 1)[0]  # Keras prints no "Epoch 1/1" header
    line = [l for l in epoch1.splitlines() if "8/8" in l][-1]
    return float(line.rsplit("loss: ", 1)[1].split()[0])

  np.testing.assert_allclose(first_epoch_loss(out), first_epoch_loss(mirrored), rtol=1e-3)


@pytest.mark.parametrize("flags, message", [
    (["--strategy=mirrored", "--cpu_replicas=2", "--global_batch_size=33"],
     "must be a positive multiple of the 2 replicas"),
    (["--model=nope"], "Unknown model 'nope'"),
    (["--strategy=multi_worker"], "needs TF_CONFIG"),
    (["--all_reduce=nccl"], "needs GPUs"),
    (["--dataset=imagenet"], "Unknown --dataset"),
    (["--no_such_flag=1"], "tfdp-train: error: Unknown command line flag 'no_such_flag'"),
    (["--train_steps=abc"], "tfdp-train: error: flag --train_steps=abc"),
])
def test_bad_flags_give_a_clear_error(flags, message):
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  proc = subprocess.run(TRAIN + ["--train_steps=1"] + flags, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, cwd=REPO, timeout=120, env=env, check=False)
  out = proc.stdout.decode()
  assert proc.returncode == 2, out
  assert message in out
  assert "Traceback" not in out


def _train(flags, **kw):
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  return subprocess.run(TRAIN + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        cwd=REPO, timeout=180, env=env, check=False, **kw)


def _one_error_line(proc):
  out = proc.stdout.decode()
  assert proc.returncode == 2, out
  assert "Traceback" not in out, out
  errors_said = [line for line in out.splitlines() if "tfdp-train: error:" in line]
  assert len(errors_said) == 1, out
  message = errors_said[0].split("tfdp-train: error:", 1)[1].strip()
  assert out.count(message[:60]) == 1, out  # said once, not also logged
  return errors_said[0]


def test_bad_paths_give_one_line_before_tensorflow_starts(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("not a directory")
  line = _one_error_line(_train(["--train_steps=1", f"--model_dir={a_file}"]))
  assert "--model_dir" in line and "is a file" in line
  line = _one_error_line(_train(["--train_steps=1", f"--data_dir={tmp_path / 'missing'}"]))
  assert "--data_dir" in line and "not a directory" in line


def test_a_second_job_on_a_busy_model_dir_is_refused_and_the_first_is_untouched(tmp_path):
  model_dir = str(tmp_path / "model")
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  first = subprocess.Popen(TRAIN + SMALL + ["--train_steps=100000", "--checkpoint_every_steps=20",
                                            f"--model_dir={model_dir}"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 180
    while not tf.train.latest_checkpoint(model_dir):
      assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()
      time.sleep(0.2)
    line = _one_error_line(_train(SMALL + ["--train_steps=100000", f"--model_dir={model_dir}"]))
    assert f"pid {first.pid}" in line, line
    assert first.poll() is None  # the first job trains on
  finally:
    first.send_signal(signal.SIGTERM)  # preempted: saves and exits 75
    out = first.communicate(timeout=120)[0].decode()
  assert first.returncode == 75, out[-3000:]
  names = sorted(f[:-len(".index")] for f in os.listdir(model_dir) if f.endswith(".index"))
  assert names
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  for name in names:  # In this process: a `tfdp-ckpt verify` each would start TF again.
    buf = io.StringIO()
    assert ckpt.main(["verify", os.path.join(model_dir, name)], out=buf) == 0, buf.getvalue()


def test_bad_tf_config_gives_a_clear_error():
  env = dict(os.environ, TF_CONFIG='{"cluster": {"worker": ["localhost:1"]}, '
                                   '"task": {"type": "worker", "index": 3}}')
  proc = subprocess.run(TRAIN + ["--train_steps=1"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, cwd=REPO, timeout=120, env=env, check=False)
  out = proc.stdout.decode()
  assert proc.returncode == 2 and "index 3 is out of range" in out and "Traceback" not in out


@pytest.mark.parametrize("fields, message", [
    ({"local_checkpoint_every_steps": 5}, "need --model_dir"),
    ({"local_checkpoint_dir": "/dev/shm/x", "model_dir": "m"}, "takes effect with"),
    ({"local_checkpoint_every_steps": -1, "model_dir": "m"}, "pass a positive number of steps"),
    ({"local_checkpoint_every_steps": "often", "model_dir": "m"}, "or 'auto'"),
])
def test_local_tier_flags_are_checked_before_anything_starts(fields, message):
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.trainer import TrainConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError, match=message):
    TrainConfig(**fields).validate()
