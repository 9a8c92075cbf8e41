"""The README stays true to the code: every tfdp-train flag is documented, the quick start exists."""

import json
import os
import re
import subprocess
import sys

from absl import flags
import pytest

from tests.conftest import REPO, run_all


def _readme():
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_every_train_flag_is_in_the_flags_table():
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top,unused-import
  documented = set(re.findall(r"^\| `--(\w+)`", _readme(), re.M))
  ours = {f.name for f in flags.FLAGS.get_flags_for_module("tfdp.cli.train")}
  assert len(ours) > 10
  assert ours - documented == set(), "flags missing from README"
  assert documented - ours == set(), "README documents flags that do not exist"


def _data_bytes(ckpt_dir, prefix="ckpt-48"):
  return sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in os.listdir(ckpt_dir)
             if f.startswith(prefix + ".data-"))


@pytest.mark.slow
def test_python_example_runs_and_resumes(tmp_path):
  code = re.search(r"```python\n(.*?)```", _readme(), re.S).group(1)
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("TF_CONFIG", None)
  one, two = tmp_path / "one_worker", tmp_path / "two_workers"
  one.mkdir()
  two.mkdir()
  (two / "example.py").write_text(code)

  def twice(command, cwd):
    """Runs `command` in `cwd` twice: the second run finds ckpt-48 and has nothing left to train."""
    procs = []
    for _ in range(2):
      procs.append(subprocess.run(command, cwd=cwd, env=env, timeout=300, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, check=False))
      if procs[-1].returncode:
        break
    return procs

  # The file as it is, and the same file under `tfdp-launch --num_workers=2`,
  # train then resume: its manager is built outside the strategy's scope, as
  # TF's tutorials build it. Both pairs at once (their own folders).
  alone, launched = run_all([
      lambda: twice([sys.executable, "-c", code], one),
      lambda: twice([sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--",
                     sys.executable, "example.py"], two)])
  for proc in alone:
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
  assert len(alone) == 2
  assert sorted(f for f in os.listdir(one / "runs" / "example") if f.endswith(".index")) == [
      "ckpt-16.index", "ckpt-32.index", "ckpt-48.index"]

  for proc in launched:
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
  assert len(launched) == 2
  ckpts = two / "runs" / "example"
  assert sorted(f for f in os.listdir(ckpts) if f.endswith(".index")) == [
      "ckpt-16.index", "ckpt-32.index", "ckpt-48.index"]
  with open(ckpts / "ckpt-48.manifest.json", encoding="utf-8") as f:
    manifest = json.load(f)
  assert manifest["world_size"] == 2
  # 1x the state per save, not one copy per worker.
  assert _data_bytes(ckpts) <= 1.05 * _data_bytes(one / "runs" / "example")


def test_quick_start_commands():
  readme = _readme()
  assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
  for path in ("scripts/demo.sh", "scripts/test.sh", ".ci/run"):
    assert os.path.exists(os.path.join(REPO, path)), path
  with open(os.path.join(REPO, ".ci/run"), encoding="utf-8") as f:
    assert "bash scripts/test.sh" in f.read()
