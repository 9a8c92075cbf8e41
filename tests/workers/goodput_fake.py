"""A TensorFlow-free training worker for goodput accounting: restores, steps, beats, saves, dies on cue.

Usage: goodput_fake.py MODEL_DIR STEPS KILL_AT [STEP_SECONDS SAVE_EVERY BEAT_EVERY].
Every worker resumes from the newest "checkpoint" (MODEL_DIR/ckpt, a step
the chief writes every SAVE_EVERY steps) as the chief read it, steps every STEP_SECONDS, beats
its heartbeat file (when tfdp-launch gives one) at every BEAT_EVERY-th step,
and, in a run that restored nothing, stops at step KILL_AT: once every
worker has reached it (a step is collective) the chief SIGKILLs itself
there, and the others wait as in a collective that the chief never joins.
BEAT_EVERY > 1 stands for tfdp.liveness.heartbeat.Heartbeat's 4 beats a second over
fast steps. Every worker keeps a tfdp.goodput.Recorder (the
chief records); at the end the chief prints whether TensorFlow was loaded.
Without tfdp-launch it runs as the chief of one worker.
"""

import os
import signal
import sys
import time

from tfdp import goodput

STEP_SECONDS = 0.05  # attempt 0 outlasts goodput.WRITE_INTERVAL
SAVE_EVERY = 5
SAVE_SECONDS = 0.02


def _wait_for(paths, why):
  """Polls until every file of `paths` exists; exits with `why` after 120 s."""
  deadline = time.monotonic() + 120
  while not all(os.path.exists(p) for p in paths):
    if time.monotonic() > deadline:
      sys.exit(why)
    time.sleep(0.005)


def _restore(model_dir, ckpt, chief):
  """The step every worker of this attempt restores: the chief's read of `ckpt` (None: fresh).

  The others take the chief's answer, as real workers restore one
  checkpoint: one that starts late must not read a checkpoint the chief
  wrote meanwhile, and run past KILL_AT.
  """
  start = os.environ.get("TFDP_ATTEMPT_START")
  answer = os.path.join(model_dir, f"restored-{start}") if start else None
  if chief:
    restored = None
    if os.path.exists(ckpt):
      with open(ckpt, encoding="utf-8") as f:
        restored = int(f.read())
    if answer:
      with open(answer + ".tmp", "w", encoding="utf-8") as f:
        f.write(str(restored))
      os.replace(answer + ".tmp", answer)
    return restored
  _wait_for([answer], f"no answer from the chief in {answer}")
  with open(answer, encoding="utf-8") as f:
    text = f.read()
  return None if text == "None" else int(text)


def _meet(model_dir, step, chief):
  """Every worker reaches `step` before the chief dies there, as a collective step ensures.

  Without it a worker started late (a loaded machine) would still be steps
  behind when the chief is SIGKILLed, which no synchronous job can be.
  """
  start = os.environ.get("TFDP_ATTEMPT_START", "none")
  index = os.environ.get("TFDP_WORKER_INDEX", "0")
  mark = os.path.join(model_dir, f"reached-{step}-{start}")
  if not chief:
    with open(f"{mark}-{index}", "w", encoding="utf-8"):
      pass
    return
  others = range(1, int(os.environ.get("TFDP_NUM_WORKERS", "1")))
  _wait_for([f"{mark}-{i}" for i in others], f"the other workers never reached step {step}")


def main():
  model_dir, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  step_seconds, save_every, beat_every = STEP_SECONDS, SAVE_EVERY, 1
  if len(sys.argv) > 4:
    step_seconds, save_every, beat_every = (float(sys.argv[4]), int(sys.argv[5]),
                                            int(sys.argv[6]))
  chief = os.environ.get("TFDP_WORKER_INDEX", "0") == "0"
  recorder = goodput.Recorder(model_dir, chief=chief, tensorboard=False)
  ckpt = os.path.join(model_dir, "ckpt")
  began = time.time()
  restored = _restore(model_dir, ckpt, chief)
  recorder.restored(restored, time.time() - began, "persistent" if restored else None)
  beat_file = os.environ.get("TFDP_HEARTBEAT_FILE")
  for step in range((restored or 0) + 1, steps + 1):
    time.sleep(step_seconds)
    if beat_file and step % beat_every == 0:
      with open(beat_file, "w", encoding="utf-8") as f:
        f.write(f"{step} {time.time()}\n")
    recorder.step(step)
    if restored is None and step == kill_at:
      _meet(model_dir, kill_at, chief)
      if chief:
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(60)
    if chief and step % save_every == 0:
      began = time.time()
      time.sleep(SAVE_SECONDS)
      with open(ckpt + ".tmp", "w", encoding="utf-8") as f:
        f.write(str(step))
      os.replace(ckpt + ".tmp", ckpt)
      recorder.blocked(time.time() - began, "persistent")
  recorder.finished(steps)
  if chief:
    print(f"done; tensorflow loaded: {'tensorflow' in sys.modules}", flush=True)


if __name__ == "__main__":
  main()
