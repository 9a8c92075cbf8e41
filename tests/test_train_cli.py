"""End-to-end tests of tfdp-train: 2 real workers through tfdp-launch, resume, flag errors."""

import io
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, run_all
from tests.resume_run import STEPS_PER_EPOCH, TRAIN, TRAIN_STEPS, reference_of
from tests import shared
from tests.shared import shared_run

SMALL = ["--model=cnn", "--dataset=synthetic", "--global_batch_size=32",
         "--num_examples=512", "--steps_per_epoch=8", "--seed=1"]


@pytest.fixture(scope="module")
def two_worker_run(resume_runs):
  """The shared uninterrupted 2-worker MultiWorkerMirroredStrategy run (tests/resume_run.py)."""
  return reference_of(resume_runs)


@pytest.mark.slow
def test_two_workers_train_and_leave_a_standard_checkpoint(two_worker_run):
  model_dir, out = two_worker_run["model_dir"], two_worker_run["out"]
  final = tf.train.latest_checkpoint(model_dir)
  assert final == os.path.join(model_dir, f"ckpt-{TRAIN_STEPS}"), out
  reader = tf.train.load_checkpoint(final)
  assert reader.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == TRAIN_STEPS
  assert reader.get_tensor("model/conv2d/kernel/.ATTRIBUTES/VARIABLE_VALUE").shape == (3, 3, 3, 16)
  # Both workers wrote a part of it.
  assert sorted(f for f in os.listdir(model_dir) if f.startswith(f"ckpt-{TRAIN_STEPS}.data")) == [
      f"ckpt-{TRAIN_STEPS}.data-00000-of-00002", f"ckpt-{TRAIN_STEPS}.data-00001-of-00002"]
  # Only the chief prints the progress bar and the final path.
  assert "[worker 0] Epoch 1/" in out and "[worker 1] Epoch" not in out
  assert f"Final checkpoint at step {TRAIN_STEPS}" in out


@pytest.mark.slow
def test_rerun_resumes_from_the_checkpoint(resume_runs):
  # The shared 2-worker run SIGKILLed past step 20, then run again (tests/resume_run.py).
  killed = resume_runs["killed"]
  stop, out = max(killed["steps"]), killed["resumed"]
  assert killed["resumed_code"] == 0, out[-5000:]
  assert "Restored" in out and f"at step {stop}" in out
  # The kill cut an epoch (8 steps each: stop is 20 or 30), which the rerun
  # finishes first; steps 56..59 are a short epoch 8.
  cut = stop // STEPS_PER_EPOCH + 1
  assert stop % STEPS_PER_EPOCH and f"Epoch {cut}/{cut}" in out, out[-3000:]
  assert f"Epoch {cut + 1}/" in out and "Epoch 8/8" in out and "Epoch 1/" not in out, out[-3000:]
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(killed["model_dir"]))
  assert reader.get_tensor("optimizer/iteration/.ATTRIBUTES/VARIABLE_VALUE") == TRAIN_STEPS


@pytest.mark.slow
def test_mirrored_run_matches_the_first_losses_of_the_two_worker_run(two_worker_run, resume_runs):
  # 2 workers x 1 replica and 1 worker x 2 replicas see the same global batches
  # (an 8-step run with the shared flags, --strategy=mirrored --cpu_replicas=2).
  run = resume_runs["mirrored_8_steps"]
  mirrored = run["out"]
  assert run["code"] == 0, mirrored

  def first_epoch_loss(text):
    epoch1 = text.split("Epoch 2/", 1)[0]  # Keras prints no "Epoch 1/1" header
    line = [l for l in epoch1.splitlines() if "8/8" in l][-1]
    return float(line.rsplit("loss: ", 1)[1].split()[0])

  np.testing.assert_allclose(first_epoch_loss(two_worker_run["out"]), first_epoch_loss(mirrored),
                             rtol=1e-3)


BAD_FLAGS = [
    (["--strategy=mirrored", "--cpu_replicas=2", "--global_batch_size=33"],
     "must be a positive multiple of the 2 replicas"),
    (["--model=nope"], "Unknown model 'nope'"),
    (["--strategy=multi_worker"], "needs TF_CONFIG"),
    (["--all_reduce=nccl"], "needs GPUs"),
    (["--dataset=imagenet"], "Unknown --dataset"),
    (["--no_such_flag=1"], "tfdp-train: error: Unknown command line flag 'no_such_flag'"),
    (["--train_steps=abc"], "tfdp-train: error: flag --train_steps=abc"),
]
BAD_TF_CONFIG = ('{"cluster": {"worker": ["localhost:1"]}, '
                 '"task": {"type": "worker", "index": 3}}')


@shared_run("refused_runs")
def refused_runs(root):
  """Every refused tfdp-train command of this file, 3 at a time: {name: [exit code, output]}."""
  a_file = root / "file"
  a_file.write_text("not a directory")
  runs = {" ".join(flags): (["--train_steps=1"] + flags, None) for flags, _ in BAD_FLAGS}
  runs["model_dir"] = (["--train_steps=1", f"--model_dir={a_file}"], None)
  runs["data_dir"] = (["--train_steps=1", f"--data_dir={root / 'missing'}"], None)
  runs["tf_config"] = (["--train_steps=1"], {"TF_CONFIG": BAD_TF_CONFIG})
  names = sorted(runs)
  done = run_all([lambda n=n: _train(runs[n][0], timeout=120, env=runs[n][1],
                                     command=TRAIN_SAYING_TF) for n in names],
                 parallel=3)
  return {n: [p.returncode, p.stdout.decode("utf-8", errors="replace")]
          for n, p in zip(names, done)}


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_flags_give_a_clear_error(refused_runs, flags, message):
  code, out = refused_runs[" ".join(flags)]
  assert code == 2, out
  assert message in out
  assert "Traceback" not in out


# tfdp-train's entry point, which says at exit whether TensorFlow was imported.
TRAIN_SAYING_TF = [sys.executable, "-c", (
    "import atexit, sys\n"
    "atexit.register(lambda: print('tensorflow imported:', 'tensorflow' in sys.modules))\n"
    "sys.argv[0] = 'tfdp-train'\n"
    "from tfdp.cli import train\n"
    "train.run()\n")]
# Refusals that need nothing TensorFlow knows: made before it is imported.
REFUSED_BEFORE_TF = ["--no_such_flag=1", "--train_steps=abc", "--strategy=multi_worker",
                     "model_dir", "data_dir", "tf_config"]


def _train(flags, timeout=180, env=None, command=TRAIN):
  """tfdp-train FLAGS without TF_CONFIG (unless `env` sets one): its CompletedProcess."""
  full_env = shared.environ()
  full_env.pop("TF_CONFIG", None)
  full_env.update(env or {})
  return subprocess.run(command + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        cwd=REPO, timeout=timeout, env=full_env, check=False)


def _one_error_line(code, out):
  assert code == 2, out
  assert "Traceback" not in out, out
  errors_said = [line for line in out.splitlines() if "tfdp-train: error:" in line]
  assert len(errors_said) == 1, out
  message = errors_said[0].split("tfdp-train: error:", 1)[1].strip()
  assert out.count(message[:60]) == 1, out  # said once, not also logged
  return errors_said[0]


@pytest.mark.slow
def test_bad_paths_give_one_line_before_tensorflow_starts(refused_runs):
  line = _one_error_line(*refused_runs["model_dir"])
  assert "--model_dir" in line and "is a file" in line
  line = _one_error_line(*refused_runs["data_dir"])
  assert "--data_dir" in line and "not a directory" in line


@pytest.mark.slow
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
    second = _train(SMALL + ["--train_steps=100000", f"--model_dir={model_dir}"])
    line = _one_error_line(second.returncode, second.stdout.decode())
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


@pytest.mark.slow
def test_refusals_come_before_tensorflow_starts_where_they_can(refused_runs):
  # A bad flag, path or cluster costs a fraction of a second, with no TF start-up lines.
  for name in REFUSED_BEFORE_TF:
    code, out = refused_runs[name]
    assert code == 2 and "tensorflow imported: False" in out, (name, out)
  # The wrapper does see TensorFlow when it is imported: the model registry is Keras's.
  code, out = refused_runs["--model=nope"]
  assert code == 2 and "tensorflow imported: True" in out, out


@pytest.mark.slow
def test_bad_tf_config_gives_a_clear_error(refused_runs):
  code, out = refused_runs["tf_config"]
  assert code == 2 and "index 3 is out of range" in out and "Traceback" not in out


@pytest.mark.parametrize("fields, message", [
    ({"local_checkpoint_every_steps": 5}, "need --model_dir"),
    ({"local_checkpoint_dir": "/dev/shm/x", "model_dir": "m"}, "takes effect with"),
    ({"local_checkpoint_every_steps": -1, "model_dir": "m"}, "pass a positive number of steps"),
    ({"local_checkpoint_every_steps": "often", "model_dir": "m"}, "or 'auto'"),
])
def test_local_tier_flags_are_checked_before_anything_starts(fields, message):
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.app.trainer import TrainConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError, match=message):
    TrainConfig(**fields).validate()
