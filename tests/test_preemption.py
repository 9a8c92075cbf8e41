"""Preemption of tfdp-train: SIGTERM to one worker -> agreed step, save, exit code; grace period; resume."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_all
from tests.resume_run import FINAL, assert_bitwise_equal, committed_steps, interrupt
from tests.resume_run import reference_of, resume
from tfdp import preemption


def test_exit_codes_are_distinct_and_documented():
  assert preemption.EXIT_PREEMPTED == 75
  assert preemption.EXIT_GRACE_EXPIRED == 128 + signal.SIGTERM
  assert preemption.Preempted(7, "x").code == preemption.EXIT_PREEMPTED


def _freeze_then_terminate(elapsed):
  """An `interrupt` action: SIGSTOP to worker 1, then SIGTERM to worker 0.

  Appends to `elapsed` the seconds from the SIGTERM to the launcher's report of the grace exit.
  """
  def act(_, workers, log_path):
    os.kill(workers[1], signal.SIGSTOP)
    time.sleep(0.5)
    start = time.monotonic()
    os.kill(workers[0], signal.SIGTERM)
    needle = f"code {preemption.EXIT_GRACE_EXPIRED}"
    while needle not in open(log_path, errors="replace").read():
      assert time.monotonic() - start < 60, open(log_path).read()[-3000:]
      time.sleep(0.1)
    elapsed.append(time.monotonic() - start)
  return act


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """Both interrupted 2-worker runs of this file, at once (their own directories).

  "sigterm": SIGTERM to worker 1 past step 20; "frozen": worker 1 frozen
  past step 10, then SIGTERM to worker 0 (grace 2 s). Each is {"model_dir", "code",
  "out"}; "frozen" also has "elapsed" (seconds from the SIGTERM to the
  launcher's report).
  """
  root = tmp_path_factory.mktemp("preempted")
  runs = {"sigterm": {"model_dir": str(root / "sigterm")},
          "frozen": {"model_dir": str(root / "frozen"), "elapsed": []}}
  done = run_all([
      lambda: interrupt(runs["sigterm"]["model_dir"], "sigterm_worker"),
      lambda: interrupt(runs["frozen"]["model_dir"], _freeze_then_terminate(
          runs["frozen"]["elapsed"]), after_step=10, grace_seconds=1,
                        flags=["--preemption_grace_seconds=2"])])
  for run, (code, out) in zip(runs.values(), done):
    run.update(code=code, out=out)
  return runs


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_both_at_one_step_and_resumes_bitwise(
    resume_runs, interrupted):
  reference = reference_of(resume_runs)["final"]
  model_dir, code, out = (interrupted["sigterm"][k] for k in ("model_dir", "code", "out"))
  assert code != 0
  # Worker 1 got the signal; both agreed, saved one checkpoint together and
  # exited with the preemption code (the launcher reports the first).
  assert f"code {preemption.EXIT_PREEMPTED}" in out, out[-5000:]
  assert "[worker 1]" in out and "received SIGTERM" in out, out[-5000:]
  stop = max(committed_steps(model_dir))
  assert 20 < stop < 60 and stop % 10, out[-3000:]
  assert f"[worker 0] " in out and f"saved {model_dir}/ckpt-{stop} at step {stop}" in out
  assert len([f for f in os.listdir(model_dir)
              if f.startswith(f"ckpt-{stop}.data")]) == 2
  resumed = resume(model_dir)
  assert f"at step {stop}" in resumed
  assert_bitwise_equal(reference, os.path.join(model_dir, FINAL))


@pytest.mark.slow
def test_a_worker_that_cannot_save_exits_when_the_grace_period_ends(interrupted):
  # Worker 1 is frozen (SIGSTOP), so worker 0 blocks in the next collective
  # and can never agree or save; after --preemption_grace_seconds it exits
  # with EXIT_GRACE_EXPIRED although its main thread is stuck inside TF and
  # its peer watchdog is checking the hung peer (TF's check holds the GIL:
  # see test_fault_tolerance's hung-peer test). The grace ends well before
  # TF's coordination service (10 s of missed heartbeats) aborts the step.
  frozen = interrupted["frozen"]
  code, out, elapsed = frozen["code"], frozen["out"], frozen["elapsed"]
  assert code != 0
  assert "no preemption checkpoint within the grace period of 2.0 s" in out, out[-3000:]
  assert 2 <= elapsed[0] < 15, elapsed
  assert 60 not in committed_steps(frozen["model_dir"])


@pytest.mark.slow
def test_the_grace_watchdog_works_again_after_a_reinstall():
  # A second plain model.fit in one process installs the handler again.
  code = ("import os, signal, time\n"
          "from tfdp import preemption\n"
          "h = preemption.SignalHandler(grace_seconds=0.5)\n"
          "h.install(); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
          "h.finished(); h.uninstall()\n"
          "h.install()\n"
          "assert not h.requested, 'a signal of the last fit preempts this one'\n"
          "os.kill(os.getpid(), signal.SIGTERM)\n"
          "time.sleep(20)\n"
          "print('survived the grace period')\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
  assert proc.returncode == preemption.EXIT_GRACE_EXPIRED, proc.stdout.decode()[-2000:]


def test_ctrl_c_requests_preemption_as_sigterm_does():
  """SIGINT (Ctrl-C, or forwarded by tfdp-launch) sets the same flag; the previous handler comes back."""
  before = signal.getsignal(signal.SIGINT)
  handler = preemption.SignalHandler(grace_seconds=None).install()
  try:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):
      if handler.requested:
        break
      time.sleep(0.01)
    assert handler.requested and handler.signum == signal.SIGINT
  finally:
    handler.uninstall()
  assert signal.getsignal(signal.SIGINT) is before
