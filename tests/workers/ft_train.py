"""tfdp-train that SIGKILLs itself where this attempt's chaos plan says (at a step or a checkpoint phase).

FT_CHAOS_PLAN is JSON {attempt: {"worker": i, "step": s} | {"worker": i,
"phase": p}}; attempt is TFDP_RESTART_COUNT (set by tfdp-launch). A step
kill fires once this worker's heartbeat reports step >= s; a phase kill
fires at the first checkpoint save of the attempt, at that phase of the
sharded save or local copy (tests/save_faults.PHASES), the writer wrapped.
With "wipe": "own" (or "all"), the worker first deletes its own local
checkpoint tier (or every worker's: the whole --local_checkpoint_dir), as a
replaced host (or a reboot of every host) would lose it.

A step kill fires in the main thread at the end of step s, after the
callbacks (its saves started); every worker also records, at each step's
end before the callbacks, the step it restored and the step it reached into
FT_REACHED_DIR/ATTEMPT-WORKER ("RESTORED REACHED"), so a test can count the
steps recomputed without tfdp's own bookkeeping.
"""

import json
import os
import shutil
import signal
import sys


def _wipe(what, me):
  if not what:
    return
  root = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--local_checkpoint_dir="))
  path = root if what == "all" else os.path.join(root, f"worker-{me}")
  shutil.rmtree(path, ignore_errors=True)
  print(f"ft_train: wiped {path}", flush=True)


def _watch_steps(attempt, me, kill_step=None, wipe=None):
  """Wraps BackupAndRestore's batch end: records the steps, SIGKILLs at `kill_step`."""
  from tfdp.callbacks import backup  # pylint: disable=g-import-not-at-top
  folder = os.environ.get("FT_REACHED_DIR")
  fd = None
  if folder:
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, f"{attempt}-{me}"), os.O_WRONLY | os.O_CREAT, 0o644)
  original = backup.BackupAndRestore.on_train_batch_end

  def on_train_batch_end(self, batch, logs=None):
    step = int(self.model.optimizer.iterations.numpy())
    if fd is not None:  # fixed width: each write replaces the last
      os.pwrite(fd, f"{self.restored_step or 0:>12} {step:>12}\n".encode(), 0)
    original(self, batch, logs)
    if kill_step is not None and step >= kill_step:
      _wipe(wipe, me)
      print(f"ft_train: SIGKILL at step {step}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  backup.BackupAndRestore.on_train_batch_end = on_train_batch_end


def _kill_at_phase(phase, me):
  from tests import save_faults  # pylint: disable=g-import-not-at-top

  def hook(reached, worker):
    if reached == phase and worker == me:
      print(f"ft_train: SIGKILL at {phase}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  save_faults.install(hook, local=True)


def main():
  plan = json.loads(os.environ.get("FT_CHAOS_PLAN") or "{}")
  attempt = os.environ.get("TFDP_RESTART_COUNT", "0")
  event = plan.get(attempt)
  me = int(os.environ.get("TFDP_WORKER_INDEX", "0"))
  step_event = event if event and event["worker"] == me and "step" in event else {}
  _watch_steps(attempt, me, step_event.get("step"), step_event.get("wipe"))
  if event and event["worker"] == me and "phase" in event:
    _kill_at_phase(event["phase"], me)
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top
  sys.argv = ["tfdp-train"] + sys.argv[1:]
  train.run()


if __name__ == "__main__":
  main()
