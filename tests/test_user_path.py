"""The user's own code under tfdp-launch with 2 real workers: a converted Keras script killed with SIGKILL and rerun."""

import difflib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, WORKERS, run_all, users_environ
from tests import shared
from tests.shared import shared_run
from tests.resume_run import committed_steps

SCRIPT = os.path.join(WORKERS, "keras_converted.py")
LOOP = os.path.join(WORKERS, "custom_loop.py")
EXAMPLES = os.path.join(REPO, "scripts", "examples")

pytestmark = pytest.mark.slow


def _children(pid):
  """Pids of the live processes whose parent is `pid`."""
  kids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[1]) == pid and fields[0] != "Z":
        kids.append(int(entry))
  return kids


def _launch(args, env=None, script=SCRIPT):
  # TF's defaults and Python's, as the user has them (conftest.py).
  full_env = users_environ(shared.environ(TF_CPP_MIN_LOG_LEVEL="2", **(env or {})))
  full_env.pop("TF_CONFIG", None)
  return subprocess.Popen(
      [sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--", sys.executable, script]
      + args, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _kill_a_worker_after(proc, model_dir, step):
  """SIGKILLs one worker of launcher `proc` once a checkpoint at `step` or later is committed."""
  deadline = time.monotonic() + 240
  while not [s for s in committed_steps(model_dir) if s >= step]:
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    assert time.monotonic() < deadline, f"no checkpoint at step {step} or later"
    time.sleep(0.1)
  workers = _children(proc.pid)
  assert len(workers) == 2, workers
  os.kill(max(workers), signal.SIGKILL)  # a worker dies as on a lost host
  out = proc.communicate(timeout=120)[0].decode("utf-8", errors="replace")
  assert proc.returncode != 0, out[-3000:]
  return out


CONVERTED = [("epoch", "1", "1"), ("5", "0", "0")]


@shared_run("converted_runs")
def converted_runs(root):
  """Each CONVERTED case killed past step 40, then rerun, both at once.

  Returns {"SAVE_FREQ-DELETE-DOUBLE": [backup, exit code, output of the rerun]}.
  """
  def kill_and_rerun(save_freq, delete, double):
    backup = str(root / f"backup-{save_freq}")
    args = [backup, save_freq, delete, double]
    _kill_a_worker_after(_launch(args, env={"TFDP_TEST_SLOW_FROM": "40"}), backup, 40)
    proc = _launch(args)
    out = proc.communicate(timeout=300)[0].decode("utf-8", errors="replace")
    return [backup, proc.returncode, out]

  done = run_all([lambda case=case: kill_and_rerun(*case) for case in CONVERTED])
  return {"-".join(case): result for case, result in zip(CONVERTED, done)}


@pytest.mark.parametrize("save_freq,delete,double", CONVERTED)
def test_converted_script_killed_and_rerun_finishes_on_both_workers(converted_runs, save_freq,
                                                                    delete, double):
  backup, code, out = converted_runs["-".join((save_freq, delete, double))]
  assert code == 0, out[-4000:]
  finals = re.findall(r"test_accuracy=([\d.]+) step=(\d+) restored_step=(\d+)", out)
  assert len(finals) == 2, out[-4000:]  # both workers finished and evaluated
  restored = int(finals[0][2])
  assert restored >= 40 and {r for _, _, r in finals} == {str(restored)}
  # The backup holds the data position: the interrupted epoch is finished,
  # not rerun, so the run is 8 epochs of 16 steps in all.
  assert {step for _, step, _ in finals} == {str(8 * 16)}
  assert all(float(acc) > 0.8 for acc, _, _ in finals), finals
  if delete == "1":
    assert not os.path.exists(backup)
  else:
    final = int(finals[0][1])
    # The last epoch end, or the last multiple of 5.
    assert committed_steps(backup)[-1] == (final if save_freq == "epoch" else final - final % 5)


@shared_run("custom_loop_runs")
def custom_loop_runs(root):
  """tests/workers/custom_loop.py on 2 workers, killed twice and rerun, beside its reference.

  Returns {"reference", "crashed", "resumed": [code, output], "committed_after_crash", "root"}.

  The uninterrupted reference (to reference.npz) runs beside the others:
  in ckpt/, worker 1 dies after writing its shard of ckpt-10, before its
  done-marker ("crashed"); the same command, slowed from step 20, loses a
  worker to SIGKILL past checkpoint 20; then it runs to the end ("resumed",
  to out.npz).
  """
  def run(ckpt_dir, out, env=None):
    proc = _launch([str(ckpt_dir), str(out)], env=env, script=LOOP)
    text = proc.communicate(timeout=300)[0].decode("utf-8", errors="replace")
    return [proc.returncode, text]

  ckpt, out = root / "ckpt", root / "out.npz"

  def crash_then_kill():
    crashed = run(ckpt, out, env={"TFDP_CKPT_TEST_CRASH_AT": "after_shard:1"})
    committed = committed_steps(str(ckpt))
    _kill_a_worker_after(_launch([str(ckpt), str(out)], script=LOOP,
                                 env={"TFDP_TEST_SLOW_FROM": "20"}), str(ckpt), 20)
    return crashed, committed

  reference, (crashed, committed) = run_all(
      [lambda: run(root / "reference", root / "reference.npz"), crash_then_kill])
  return {"root": str(root), "reference": reference, "crashed": crashed,
          "committed_after_crash": committed, "resumed": run(ckpt, out)}


def test_custom_loop_survives_a_kill_inside_a_save_and_mid_run_bitwise(custom_loop_runs):
  """tfdp.CheckpointManager in a TF-tutorial loop: SIGKILL inside its first save, then mid-run."""
  runs = custom_loop_runs
  code, text = runs["reference"]
  assert code == 0, text[-3000:]
  crash_code, crash_text = runs["crashed"]
  assert crash_code != 0 and "killing worker 1 at after_shard" in crash_text, crash_text[-3000:]
  assert runs["committed_after_crash"] == []
  code, text = runs["resumed"]
  assert code == 0, text[-3000:]
  starts = re.findall(r"custom_loop start=(\d+) step=40", text)
  assert len(starts) == 2 and set(starts) in ({"20"}, {"30"}), text[-3000:]
  root = runs["root"]
  ref, res = np.load(os.path.join(root, "reference.npz")), np.load(os.path.join(root, "out.npz"))
  assert len(ref.files) == len(res.files) > 4
  for k in ref.files:
    assert ref[k].tobytes() == res[k].tobytes(), k


@shared_run("keras_example_runs")
def keras_example_runs(root):
  """The README's example (a tf.data pipeline built before the model) as the README runs it.

  Under tfdp-launch on 2 workers, worker 1 SIGKILLed once the first epoch's
  backup is committed, then the same command again. Returns
  {"backup", "killed": output, "rerun": [exit code, output]}.
  """
  backup = str(root / "backup")
  args = ["--epochs=2", "--num_examples=2048", f"--backup_dir={backup}"]
  script = os.path.join(EXAMPLES, "keras_tfdp.py")
  killed = _kill_a_worker_after(_launch(args, script=script), backup, 1)
  proc = _launch(args, script=script)
  out = proc.communicate(timeout=300)[0].decode("utf-8", errors="replace")
  return {"backup": backup, "killed": killed, "rerun": [proc.returncode, out]}


def test_readme_example_changes_five_lines_and_resumes_under_tfdp_launch(keras_example_runs):
  example_runs = keras_example_runs
  """The README's diff applied to keras_plain.py, run, killed and rerun: the user sees the resume."""
  def lines(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
      return f.read().splitlines()[1:]
  changed = [l for l in difflib.unified_diff(lines("keras_plain.py"), lines("keras_tfdp.py"),
                                             lineterm="", n=0)
             if l[:1] in "+-" and not l.startswith(("+++", "---"))]
  assert len([l for l in changed if l.startswith("+")]) == 5, changed  # 3 new, 2 edited
  killed = example_runs["killed"]
  assert "[tfdp-launch] worker 1 was killed by SIGKILL" in killed, killed[-3000:]
  code, out = example_runs["rerun"]
  assert code == 0, out[-4000:]
  backup = example_runs["backup"]
  # The chief's first line says what it restored: an epoch's backup (save_freq="epoch").
  # 28 steps an epoch (1792 training examples, global batch 64): killed in epoch 2.
  resumed = re.findall(r"^\[worker 0\] tfdp: resumed from (\S+)/ckpt-28 at step 28 "
                       r"\(epoch 2; data position restored\)$", out, re.M)
  assert resumed == [backup], out[-4000:]
  assert "[worker 1] tfdp: resumed" not in out  # the chief only
  assert "[worker 0] Epoch 2/2" in out and "[worker 0] Epoch 1/2" not in out, out[-4000:]
  goodput = [l for l in out.splitlines() if re.match(r"\[(tfdp-launch|worker 0)\] (tfdp: )?goodput ", l)]
  assert len(goodput) == 1 and ": 1 restart (" in goodput[0], out[-4000:]
  assert not os.path.exists(backup)  # delete_checkpoint=True, as Keras's default
