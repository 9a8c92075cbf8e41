"""tfdp-train refuses to resume a checkpoint of another run config unless --allow_config_mismatch."""

import io
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

TRAIN = [sys.executable, "-m", "tfdp.cli.train"]
BASE = {"--model": "cnn", "--dataset": "synthetic", "--global_batch_size": "16",
        "--num_examples": "64", "--steps_per_epoch": "2", "--seed": "1",
        "--strategy": "default"}


def _train(model_dir, train_steps, **overrides):
  flags = dict(BASE, **{f"--{k}": str(v) for k, v in overrides.items()})
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  proc = subprocess.run(
      TRAIN + [f"{k}={v}" for k, v in flags.items()] +
      [f"--train_steps={train_steps}", f"--model_dir={model_dir}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      timeout=300, check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("config") / "model")
  code, out = _train(model_dir, 2)
  assert code == 0, out[-3000:]
  return model_dir


@pytest.mark.parametrize("overrides, message", [
    ({"global_batch_size": 32}, "global_batch_size: checkpoint has 16, this run has 32"),
    ({"seed": 2}, "seed: checkpoint has 1, this run has 2"),
    ({"num_examples": 128}, "dataset: checkpoint has"),
])
def test_resume_with_another_config_is_refused(saved, tmp_path, overrides, message):
  model_dir = str(tmp_path / "model")
  shutil.copytree(saved, model_dir)
  code, out = _train(model_dir, 4, **overrides)
  assert code == 2, out[-3000:]
  assert message in out and "--allow_config_mismatch" in out, out[-3000:]
  assert "Traceback" not in out
  assert not os.path.exists(os.path.join(model_dir, "ckpt-4.manifest.json"))


def test_allow_config_mismatch_resumes_anyway(saved, tmp_path):
  model_dir = str(tmp_path / "model")
  shutil.copytree(saved, model_dir)
  code, out = _train(model_dir, 4, global_batch_size=32, allow_config_mismatch=True)
  assert code == 0, out[-3000:]
  assert "Resuming despite a config mismatch: global_batch_size" in out
  assert "at step 2" in out
  assert os.path.exists(os.path.join(model_dir, "ckpt-4.manifest.json"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_latest_checkpoint_is_set_aside_and_the_run_goes_on(saved, tmp_path, damage):
  model_dir = str(tmp_path / "model")
  shutil.copytree(saved, model_dir)
  code, out = _train(model_dir, 4)
  assert code == 0, out[-3000:]
  latest = os.path.join(model_dir, "ckpt-4")
  with open(latest + ".data-00000-of-00001", "r+b") as f:
    if damage == "flip":  # Same size, bad bytes.
      f.seek(100)
      b = f.read(1)
      f.seek(100)
      f.write(bytes([b[0] ^ 0xFF]))
    else:  # The run-config check must not read it before its size is checked.
      f.truncate(1000)
  code, out = _train(model_dir, 4)
  assert code == 0, out[-3000:]
  assert "Skipping a corrupt checkpoint" in out and "ckpt-4" in out, out[-3000:]
  assert "ckpt-2 at step 2" in out, out[-3000:]
  # ckpt-4 was written again from step 2 and is intact.
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  buf = io.StringIO()  # In this process: `tfdp-ckpt verify` would start TF again.
  assert ckpt.main(["verify", latest], out=buf) == 0, buf.getvalue()
