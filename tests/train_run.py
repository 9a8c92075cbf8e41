"""One small tfdp-train run, SIGKILLed at step 13 and resumed to 24 then rerun, shared by test_summaries and test_eval."""

import os
import subprocess
import sys
import time

from tests import shared
from tests.conftest import REPO, WORKERS

TRAIN_STEPS = 24
KILL_AT = 13  # past the checkpoint (and evaluation) at step 10
FLAGS = ["--model=cnn", "--dataset=synthetic", "--global_batch_size=16", "--num_examples=256",
         "--steps_per_epoch=8", "--seed=1", "--cpu_replicas=2", "--checkpoint_every_steps=5",
         "--eval_every_steps=5", "--eval_steps=2", "--summary_every_steps=1",
         "--keep_best=val_loss:min:2", "--max_to_keep=1", f"--train_steps={TRAIN_STEPS}"]
KILLABLE = [sys.executable, os.path.join(WORKERS, "kill_at_step.py")]


# Loads model.keras in a process that never imports tfdp (nor the models
# package): predictions from the file, then from the final checkpoint's
# tensors (read by plain TF) assigned to the same model, must be equal.
PLAIN_KERAS_CHECK = """
import sys
import keras, numpy as np, tensorflow as tf
model_file, checkpoint = sys.argv[1:]
model = keras.models.load_model(model_file)
x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
from_file = model.predict(x, verbose=0)
reader = tf.train.load_checkpoint(checkpoint)
for w in model.weights:
  w.assign(reader.get_tensor("model/" + w.path + "/.ATTRIBUTES/VARIABLE_VALUE"))
from_checkpoint = model.predict(x, verbose=0)
assert not [m for m in sys.modules if m.split(".")[0] in ("tfdp", "models")]
np.testing.assert_array_equal(from_file, from_checkpoint)
print("OK", len(model.weights))
"""


def _env(env=None):
  env = shared.environ(**(env or {}))
  env.pop("TF_CONFIG", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def _result(proc, start):
  out, err = proc.communicate(timeout=300)
  return {"code": proc.returncode, "stdout": out.decode(errors="replace"),
          "stderr": err.decode(errors="replace"), "seconds": round(time.monotonic() - start, 1)}


def _start(command, env=None, cwd=REPO):
  return subprocess.Popen(command, cwd=cwd, env=_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)


def _run(command, env=None):
  start = time.monotonic()
  return _result(_start(command, env), start)


def event_files(model_dir, run="train"):
  folder = os.path.join(model_dir, "logs", run)
  return sorted(os.path.join(folder, f) for f in os.listdir(folder)) if os.path.isdir(
      folder) else []


def killed_resumed_rerun(root):
  """Runs the three tfdp-train processes in folder `root`; returns their results.

  The `train_runs` fixture of tests/conftest.py (made once per session).
  killed: to step 13 (checkpoints 5 and 10), then SIGKILL; resumed: the
  same command, to step 24; rerun: the same command again (already
  complete), beside `plain_keras`, which loads model.keras without tfdp.
  Each result has code, stdout, stderr and seconds; `files_after_*` list
  the event files after each run.
  """
  model_dir = str(root / "model")
  flags = FLAGS + [f"--model_dir={model_dir}"]
  results = {"model_dir": model_dir}
  results["killed"] = _run(KILLABLE + flags, env={"TFDP_TEST_KILL_AT": str(KILL_AT)})
  results["files_after_kill"] = {r: event_files(model_dir, r) for r in ("train", "validation")}
  results["resumed"] = _run(KILLABLE + flags)
  results["files_after_resume"] = {r: event_files(model_dir, r) for r in ("train", "validation")}
  # The plain-Keras check runs beside the rerun (they only read).
  start = time.monotonic()
  check = _start([sys.executable, "-c", PLAIN_KERAS_CHECK, os.path.join(model_dir, "model.keras"),
                  os.path.join(model_dir, f"ckpt-{TRAIN_STEPS}")],
                 env={"PYTHONPATH": ""}, cwd=str(root))
  results["rerun"] = _run(KILLABLE + flags)
  results["plain_keras"] = _result(check, start)
  results["files_after_rerun"] = {r: event_files(model_dir, r) for r in ("train", "validation")}
  return results
