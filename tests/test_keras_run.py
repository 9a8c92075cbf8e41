"""A user's whole Keras run under tfdp-launch on 2 workers, killed twice and rerun: the same files, decisions and metrics as the run that never stopped.

tests/workers/keras_run.py is the script (a CNN on a tf.data pipeline with
RandomFlip; fit with validation, TensorBoard, ModelCheckpoint(save_best_only),
EarlyStopping, CSVLogger and BackupAndRestore(save_freq=20,
local_checkpoint_every_steps="auto"); verbose=2; op determinism; 10 steps an
epoch, EarlyStopping ends it after 4). Two shared launch sequences, side by
side: the uninterrupted reference, and a chain of three launches in one
directory: worker 1 SIGKILLs itself in epoch 2 (step 15, before its
backups), then on epoch 2's last step (step 20, after its local save, as
its validation begins), then the run goes to its end.
"""

import collections
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tfdp.checkpoint.schedule import policy
from tests import shared
from tests import tensorboard_events
from tests.conftest import REPO, WORKERS, run_all
from tests.shared import shared_run

SCRIPT = os.path.join(WORKERS, "keras_run.py")
KILLS = ("15:batch", "20:validation", None)
EPOCHS_RUN = 4  # EarlyStopping(patience=3) stops it after the 4th

pytestmark = pytest.mark.slow


def _launch(out, tmp, env):
  full_env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmp), **env)
  full_env.pop("TF_CONFIG", None)
  os.makedirs(tmp, exist_ok=True)
  proc = subprocess.run(
      [sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--", sys.executable, SCRIPT,
       str(out)], cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      timeout=300, check=False)
  return [proc.returncode, proc.stdout.decode("utf-8", errors="replace")]


@shared_run("keras_runs")
def keras_runs(root):
  """The reference (with the mixed_bfloat16 cell after it) beside the killed chain.

  Returns {"root", "reference": [code, output], "chain": [[code, output] x 3]}.
  """
  def chain():
    return [_launch(root / "cut", root / "tmp-cut", {"TFDP_TEST_KILL": k} if k else {})
            for k in KILLS]

  reference, launches = run_all([
      lambda: _launch(root / "ref", root / "tmp-ref", {"TFDP_TEST_BF16": "1"}), chain])
  return {"root": str(root), "reference": reference, "chain": launches}


def _records(out):
  """{pid: (worker, [records])} of every process of the runs in `out`."""
  found = {}
  for path in glob.glob(os.path.join(out, "records", "worker*.jsonl")):
    with open(path, encoding="utf-8") as f:
      lines = [json.loads(l) for l in f if l.strip()]
    found[lines[0]["pid"]] = (lines[0]["worker"], lines[1:])
  return found


@pytest.fixture(scope="module")
def runs(keras_runs):
  code, out = keras_runs["reference"]
  assert code == 0, out[-4000:]
  codes = [c for c, _ in keras_runs["chain"]]
  assert codes[0] != 0 and codes[1] != 0 and codes[2] == 0, [
      out[-2000:] for _, out in keras_runs["chain"]]
  return keras_runs


def test_every_file_has_one_writer_the_chief(runs):
  for name in ("ref", "cut"):
    out = os.path.join(runs["root"], name)
    records = _records(out)
    chiefs = {pid for pid, (worker, _) in records.items() if worker == 0}
    writers = collections.defaultdict(set)
    for pid, (worker, lines) in records.items():
      for line in lines:
        if "wrote" in line:
          writers[line["wrote"]].add(worker)
    assert dict(writers) == {"log.csv": {0}, "best.keras": {0}, "final.keras": {0}}, (name, writers)
    # TensorBoard names its files with the writer's pid: the chiefs' only.
    _, pids = tensorboard_events.scalars(os.path.join(out, "tb"))
    assert pids and pids <= chiefs, (name, pids, records.keys())
    if name == "ref":  # One file in train/, one in validation/.
      assert len(glob.glob(os.path.join(out, "tb", "*", "*tfevents*"))) == 2
  # The other worker's temporary copies are gone once it ends.
  assert not glob.glob(os.path.join(runs["root"], "tmp-ref", "tfdp-not-chief-*"))


def test_killed_run_writes_the_uninterrupted_runs_csv_and_tensorboard_events(runs):
  root = runs["root"]
  with open(os.path.join(root, "ref", "log.csv"), "rb") as f:
    reference = f.read()
  with open(os.path.join(root, "cut", "log.csv"), "rb") as f:
    assert f.read() == reference
  assert reference.count(b"\n") == 1 + EPOCHS_RUN
  ref_events, _ = tensorboard_events.scalars(os.path.join(root, "ref", "tb"))
  cut_events, _ = tensorboard_events.scalars(os.path.join(root, "cut", "tb"))
  # Each tag at each step once, with the reference's value (the lost attempts'
  # events past their backups are gone).
  assert cut_events == ref_events and len(ref_events) > 2 * EPOCHS_RUN


def test_early_stopping_and_epoch_metrics_equal_at_every_epoch_end(runs):
  root = runs["root"]
  reference = {}
  for worker, lines in _records(os.path.join(root, "ref")).values():
    for line in lines:
      if "epoch" in line:
        reference.setdefault(line["epoch"], line)
        assert reference[line["epoch"]] == line  # both workers saw the same
  assert sorted(reference) == list(range(EPOCHS_RUN))
  assert reference[EPOCHS_RUN - 1]["early_stopping"]["stopped_epoch"] == EPOCHS_RUN - 1
  seen = set()
  for worker, lines in _records(os.path.join(root, "cut")).values():
    for line in lines:
      if "epoch" in line:
        seen.add(line["epoch"])
        # Bitwise the same logs (op determinism), the same EarlyStopping state.
        assert line == reference[line["epoch"]], (worker, line, reference[line["epoch"]])
  assert seen == set(reference)


def test_resumes_mid_epoch_and_after_an_epochs_last_step_with_no_epoch_without_steps(runs):
  outputs = [runs["reference"][1]] + [out for _, out in runs["chain"]]
  for i, out in enumerate(outputs):
    epochs = re.findall(r"^\[worker (\d)\] (\d+/10 - .*)$", out, re.M)
    assert {w for w, _ in epochs} == ({"0"} if i in (0, 3) else {"0"} & {w for w, _ in epochs}), (
        out[-3000:])  # verbose=2: the chief only
    for _, line in epochs:
      assert " - accuracy: " in line and " - loss: " in line and " - val_loss: " in line, line
  first, second, third = (out for _, out in runs["chain"])
  assert "tfdp: resumed" not in first
  # Killed at step 15 before its backups: a local copy of step 14 or earlier.
  resumed = re.findall(r"^\[worker 0\] tfdp: resumed from \S+ (?:\(the \w+ tier\) )?at step (\d+) "
                       r"\(epoch 2, step (\d+) of it; data position restored, [\d.]+ [KM]?B per "
                       r"worker\)$", second, re.M)
  assert len(resumed) == 1 and int(resumed[0][0]) <= 14, second[-3000:]
  # Killed on step 20, epoch 2's last, once its local save is committed on
  # both workers ('auto' saves every step in its first 25): the rerun ends
  # epoch 2 (validation, the callbacks' epoch end) and goes on at epoch 3.
  resumed = re.findall(r"^\[worker 0\] tfdp: resumed from .* at step (\d+) \(epoch 2, .*\)$",
                       third, re.M)
  assert resumed == ["20"], third[-3000:]
  assert "the epoch's steps are done, its end runs again" in third
  assert re.findall(r"^\[worker 0\] Epoch (\d)/5$", third, re.M) == ["2", "3", "4"], third[-3000:]


def test_auto_interval_is_announced_by_the_chief(runs):
  out = runs["reference"][1]
  lines = re.findall(r"^\[worker (\d)\] tfdp: local saves every (\d+) step\(s\) "
                     r"\(local_checkpoint_every_steps='auto': a save costs ([\d.]+) ms on worker "
                     r"(\d), blocked plus its writer's CPU; a step ([\d.]+) ms; the budget is "
                     r"(\d+)% of the training time\)$", out, re.M)
  assert lines and {w for w, *_ in lines} == {"0"}, out[-3000:]
  # The agreed interval follows from the figures the line gives (those of
  # the worker that proposed it), up to their rounding to 0.1 ms.
  for _, every, cost, _, step, budget in lines:
    rule = policy.EveryAutoSteps(int(budget) / 100)
    low = rule.interval_for((float(cost) - 0.05) / 1e3, (float(step) + 0.05) / 1e3)
    high = rule.interval_for((float(cost) + 0.05) / 1e3, (float(step) - 0.05) / 1e3)
    assert low <= int(every) <= high, (every, cost, step, budget)
