"""tfdp-train refuses to resume a checkpoint of another run config unless --allow_config_mismatch."""

import io
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_all
from tests import shared
from tests.shared import shared_run

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "tfdp.cli.train"]
BASE = {"--model": "cnn", "--dataset": "synthetic", "--global_batch_size": "16",
        "--num_examples": "64", "--steps_per_epoch": "2", "--seed": "1",
        "--strategy": "default"}


def _train(model_dir, train_steps, **overrides):
  flags = dict(BASE, **{f"--{k}": str(v) for k, v in overrides.items()})
  env = shared.environ()
  env.pop("TF_CONFIG", None)
  proc = subprocess.run(
      TRAIN + [f"{k}={v}" for k, v in flags.items()] +
      [f"--train_steps={train_steps}", f"--model_dir={model_dir}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      timeout=300, check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


REFUSED = [
    ({"global_batch_size": 32}, "global_batch_size: checkpoint has 16, this run has 32"),
    ({"seed": 2}, "seed: checkpoint has 1, this run has 2"),
    ({"num_examples": 128}, "dataset: checkpoint has"),
]
DAMAGES = ["flip", "truncate"]


def _damage(path, damage):
  with open(path, "r+b") as f:
    if damage == "flip":  # Same size, bad bytes.
      f.seek(100)
      b = f.read(1)
      f.seek(100)
      f.write(bytes([b[0] ^ 0xFF]))
    else:  # The run-config check must not read it before its size is checked.
      f.truncate(1000)


@shared_run("config_runs")
def config_runs(root):
  """Every run of this file, two at a time: {name: [model_dir, code, output]}.

  "saved": 2 steps; then, each on its own copy of it: "refused-I" (with
  REFUSED[I]'s flags), "allowed" (another batch size and
  --allow_config_mismatch), "to-4" (the same flags, to step 4); then
  "corrupt-DAMAGE": a copy of "to-4" with ckpt-4 damaged, the same command again.
  """
  saved = str(root / "saved")
  done = {"saved": [saved, *_train(saved, 2)]}
  if done["saved"][1]:
    return done

  def on_copy(name, source, steps, **overrides):
    model_dir = str(root / name)
    shutil.copytree(source, model_dir)
    return lambda: [model_dir, *_train(model_dir, steps, **overrides)]

  calls = {f"refused-{i}": on_copy(f"refused-{i}", saved, 4, **overrides)
           for i, (overrides, _) in enumerate(REFUSED)}
  calls["allowed"] = on_copy("allowed", saved, 4, global_batch_size=32,
                             allow_config_mismatch=True)
  calls["to-4"] = on_copy("to-4", saved, 4)
  done.update(zip(calls, run_all(list(calls.values()))))
  if done["to-4"][1] == 0:
    calls = {}
    for damage in DAMAGES:
      calls[f"corrupt-{damage}"] = on_copy(f"corrupt-{damage}", done["to-4"][0], 4)
      _damage(os.path.join(root, f"corrupt-{damage}", "ckpt-4.data-00000-of-00001"), damage)
    done.update(zip(calls, run_all(list(calls.values()))))
  return done


@pytest.fixture(scope="module")
def runs(config_runs):
  _, code, out = config_runs["saved"]
  assert code == 0, out[-3000:]
  return config_runs


@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[m.split(":")[0] for _, m in REFUSED])
def test_resume_with_another_config_is_refused(runs, case):
  message = REFUSED[case][1]
  model_dir, code, out = runs[f"refused-{case}"]
  assert code == 2, out[-3000:]
  assert message in out and "--allow_config_mismatch" in out, out[-3000:]
  assert "Traceback" not in out
  assert not os.path.exists(os.path.join(model_dir, "ckpt-4.manifest.json"))


def test_allow_config_mismatch_resumes_anyway(runs):
  model_dir, code, out = runs["allowed"]
  assert code == 0, out[-3000:]
  assert "Resuming despite a config mismatch: global_batch_size" in out
  assert "at step 2" in out
  assert os.path.exists(os.path.join(model_dir, "ckpt-4.manifest.json"))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_corrupt_latest_checkpoint_is_set_aside_and_the_run_goes_on(runs, damage):
  _, code, out = runs["to-4"]
  assert code == 0, out[-3000:]
  model_dir, code, out = runs[f"corrupt-{damage}"]
  latest = os.path.join(model_dir, "ckpt-4")
  assert code == 0, out[-3000:]
  assert "ckpt-4 (set aside: " in out, out[-3000:]
  assert "ckpt-2 at step 2" in out, out[-3000:]
  # ckpt-4 was written again from step 2 and is intact.
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  buf = io.StringIO()  # In this process: `tfdp-ckpt verify` would start TF again.
  assert ckpt.main(["verify", latest], out=buf) == 0, buf.getvalue()
