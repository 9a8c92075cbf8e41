"""A TensorFlow-free training worker for goodput accounting: restores, steps, beats, saves, dies on cue.

Usage: goodput_fake.py MODEL_DIR STEPS KILL_AT. Every worker resumes from
the newest "checkpoint" (MODEL_DIR/ckpt, a step the chief writes every
SAVE_EVERY steps), beats its heartbeat file at every step, and on attempt 0
stops at step KILL_AT: the chief SIGKILLs itself there, the others wait as
in a collective that the chief never joins. The chief keeps a
tfdp.goodput.Recorder; at the end it prints whether TensorFlow was loaded.
"""

import os
import signal
import sys
import time

from tfdp import goodput

SAVE_EVERY = 5
STEP_SECONDS = 0.05  # attempt 0 outlasts goodput.WRITE_INTERVAL
SAVE_SECONDS = 0.02


def main():
  model_dir, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  attempt = int(os.environ["TFDP_RESTART_COUNT"])
  chief = os.environ["TFDP_WORKER_INDEX"] == "0"
  recorder = goodput.Recorder(model_dir, chief=chief, tensorboard=False)
  ckpt = os.path.join(model_dir, "ckpt")
  began = time.time()
  restored = None
  if os.path.exists(ckpt):
    with open(ckpt, encoding="utf-8") as f:
      restored = int(f.read())
  recorder.restored(restored, time.time() - began, "persistent" if restored else None)
  beat_file = os.environ["TFDP_HEARTBEAT_FILE"]
  for step in range((restored or 0) + 1, steps + 1):
    time.sleep(STEP_SECONDS)
    with open(beat_file, "w", encoding="utf-8") as f:
      f.write(f"{step} {time.time()}\n")
    recorder.step(step)
    if attempt == 0 and step == kill_at:
      if chief:
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(60)
    if chief and step % SAVE_EVERY == 0:
      began = time.time()
      time.sleep(SAVE_SECONDS)
      with open(ckpt + ".tmp", "w", encoding="utf-8") as f:
        f.write(str(step))
      os.replace(ckpt + ".tmp", ckpt)
      recorder.blocked(time.time() - began, "persistent")
  recorder.finished(steps)
  print(f"done; tensorflow loaded: {'tensorflow' in sys.modules}", flush=True)


if __name__ == "__main__":
  main()
