"""tfdp-train that SIGKILLs itself where this attempt's chaos plan says (at a step or a checkpoint phase).

FT_CHAOS_PLAN is JSON {attempt: {"worker": i, "step": s} | {"worker": i,
"phase": p}}; attempt is TFDP_RESTART_COUNT (set by tfdp-launch). A step
kill fires once this worker's heartbeat reports step >= s; a phase kill
fires at the first checkpoint save of the attempt, at that phase of the
sharded save (tfdp.checkpoint.faults.PHASES), through the fault hook.
With "wipe": "own" (or "all"), the worker first deletes its own local
checkpoint tier (or every worker's: the whole --local_checkpoint_dir), as a
replaced host (or a reboot of every host) would lose it.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time


def _wipe(what, me):
  if not what:
    return
  root = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--local_checkpoint_dir="))
  path = root if what == "all" else os.path.join(root, f"worker-{me}")
  shutil.rmtree(path, ignore_errors=True)
  print(f"ft_train: wiped {path}", flush=True)


def _kill_at_step(step, wipe=None, me=0):
  path = os.environ["TFDP_HEARTBEAT_FILE"]

  def watch():
    while True:
      try:
        with open(path, encoding="utf-8") as f:
          now = int(f.read().split()[0])
      except (OSError, ValueError, IndexError):
        now = -1
      if now >= step:
        _wipe(wipe, me)
        print(f"ft_train: SIGKILL at step {now}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(0.01)

  threading.Thread(target=watch, daemon=True).start()


def _kill_at_phase(phase, me):
  from tfdp.checkpoint import faults  # pylint: disable=g-import-not-at-top

  def hook(reached, worker):
    if reached == phase and worker == me:
      print(f"ft_train: SIGKILL at {phase}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  faults.install(hook)


def main():
  plan = json.loads(os.environ.get("FT_CHAOS_PLAN") or "{}")
  event = plan.get(os.environ.get("TFDP_RESTART_COUNT", "0"))
  me = int(os.environ.get("TFDP_WORKER_INDEX", "0"))
  if event and event["worker"] == me:
    if "phase" in event:
      _kill_at_phase(event["phase"], me)
    else:
      _kill_at_step(event["step"], event.get("wipe"), me)
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top
  sys.argv = ["tfdp-train"] + sys.argv[1:]
  train.run()


if __name__ == "__main__":
  main()
