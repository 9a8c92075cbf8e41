"""Preemption of tfdp-train: SIGTERM to one worker -> agreed step, save, exit code; grace period; resume."""

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO
from tests.test_resume import FINAL, assert_bitwise_equal, committed_steps, interrupt
from tests.test_resume import reference_run, resume
from tfdp import preemption


def test_exit_codes_are_distinct_and_documented():
  assert preemption.EXIT_PREEMPTED == 75
  assert preemption.EXIT_GRACE_EXPIRED == 128 + signal.SIGTERM
  assert preemption.Preempted(7, "x").code == preemption.EXIT_PREEMPTED


def test_sigterm_to_one_worker_stops_both_at_one_step_and_resumes_bitwise(
    tmp_path_factory, tmp_path):
  reference = reference_run(tmp_path_factory)
  model_dir = str(tmp_path / "model")
  code, out = interrupt(model_dir, "sigterm_worker")
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


def test_a_worker_that_cannot_save_exits_when_the_grace_period_ends(tmp_path):
  # Worker 1 is frozen (SIGSTOP), so worker 0 blocks in the next collective
  # and can never agree or save; after --preemption_grace_seconds it exits
  # with EXIT_GRACE_EXPIRED although its main thread is stuck inside TF.
  model_dir = str(tmp_path / "model")
  elapsed = []

  def freeze_then_terminate(_, workers, log_path):
    os.kill(workers[1], signal.SIGSTOP)
    time.sleep(0.5)
    start = time.monotonic()
    os.kill(workers[0], signal.SIGTERM)
    needle = f"code {preemption.EXIT_GRACE_EXPIRED}"
    while needle not in open(log_path, errors="replace").read():
      assert time.monotonic() - start < 60, open(log_path).read()[-3000:]
      time.sleep(0.1)
    elapsed.append(time.monotonic() - start)

  code, out = interrupt(model_dir, freeze_then_terminate, after_step=10,
                        grace_seconds=1, flags=["--preemption_grace_seconds=3"])
  assert code != 0
  assert "no preemption checkpoint within the grace period of 3.0 s" in out, out[-3000:]
  assert 3 <= elapsed[0] < 15, elapsed
  assert 60 not in committed_steps(model_dir)


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
