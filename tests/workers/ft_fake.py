"""A TensorFlow-free stand-in for a training worker: beats, logs its attempt, fails on cue.

Usage: ft_fake.py LOG_DIR SCRIPT, where SCRIPT is a ';'-separated list of
`attempt:slot:action` rules (`*` matches any), first match wins; actions:
`exit=N` (beat a few times, exit N), `hang` (beat, then stop beating and
sleep), `silent` (never beat, sleep), `rm=PATH` (remove PATH, then exit 5),
`ok` (default: beat 5 times, exit 0). Each run appends a JSON line to
LOG_DIR/runs.jsonl with its attempt, slot, index and TF_CONFIG.
"""

import json
import os
import sys
import time


def main():
  log_dir, script = sys.argv[1], sys.argv[2]
  attempt = os.environ["TFDP_RESTART_COUNT"]
  slot = os.environ["TFDP_SLOT"]
  record = {"attempt": int(attempt), "slot": int(slot),
            "index": int(os.environ["TFDP_WORKER_INDEX"]),
            "num_workers": int(os.environ["TFDP_NUM_WORKERS"]),
            "tf_config": json.loads(os.environ["TF_CONFIG"]),
            "argv0": os.environ.get("FT_WRAPPED", "")}
  with open(os.path.join(log_dir, "runs.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
  action = "ok"
  for rule in filter(None, script.split(";")):
    a, s, act = rule.split(":", 2)
    if a in ("*", attempt) and s in ("*", slot):
      action = act
      break
  beat_file = os.environ["TFDP_HEARTBEAT_FILE"]

  def beat(n):
    for step in range(n):
      with open(beat_file, "w", encoding="utf-8") as f:
        f.write(f"{step} {time.time()}\n")
      time.sleep(0.1)

  if action == "silent":
    time.sleep(60)
  beat(5)
  print(f"attempt {attempt} slot {slot}: {action}", flush=True)
  if action.startswith("exit="):
    sys.exit(int(action.split("=")[1]))
  if action.startswith("rm="):
    os.remove(action.split("=", 1)[1])
    sys.exit(5)
  if action == "hang":
    time.sleep(60)


if __name__ == "__main__":
  main()
