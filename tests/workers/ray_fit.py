"""Keras fit with tfdp on a real local Ray cluster: a reference run, then one whose worker 1 loses its local dir and is SIGKILLed.

Usage: ray_fit.py ROOT. One `ray.init(num_cpus=2)` for both runs. Each run:
scripts/examples/ray_keras.py's model and data, TensorflowTrainer with 2
workers, FailureConfig(max_failures=1),
BackupAndRestore(save_freq=10, local_checkpoint_every_steps=2, a local
directory per worker) and ReportCheckpoints. In the second run worker 1
wipes its local directory and SIGKILLs itself after step KILL_AT of its
first attempt. Writes ROOT/result.json: each run's final weights (as
bytes' hex), attempts, what each attempt restored and printed, Ray's
newest reported checkpoint and the goodput line over Ray's attempts.
"""

import contextlib
import json
import os
import shutil
import signal
import sys
import time

import ray
import ray.train
from ray.train.tensorflow import TensorflowTrainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "examples"))
import ray_keras  # pylint: disable=g-import-not-at-top,wrong-import-position

# The workers get the user script's model by value, as they get this file's loop.
ray.cloudpickle.register_pickle_by_value(ray_keras)

KILL_AT, LOCAL_EVERY = 35, 2


def train_loop_per_worker(config):
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  from tfdp.integrations import ray as tfdp_ray  # pylint: disable=g-import-not-at-top

  strategy = tfdp.make_strategy()
  tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(1)
  started = time.time()
  rank = ray.train.get_context().get_world_rank()
  root = config["root"]
  attempt_path = os.path.join(root, f"attempts-{rank}")
  attempt = len(os.listdir(attempt_path)) if os.path.isdir(attempt_path) else 0
  os.makedirs(os.path.join(attempt_path, str(attempt)))
  local_dir = os.path.join(root, "local", f"w{rank}")
  model, x, y = ray_keras.model_and_data(strategy)
  backup = tfdp.callbacks.BackupAndRestore(
      backup_dir=os.path.join(root, "backup"), save_freq=10, delete_checkpoint=False,
      local_checkpoint_dir=local_dir, local_checkpoint_every_steps=LOCAL_EVERY)

  class Kill(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if (config["kill"] and rank == 1 and attempt == 0
          and int(self.model.optimizer.iterations.numpy()) == KILL_AT):
        # Its step-34 copy is written and sent to worker 0 in a writer thread;
        # wait for it, or under a loaded CPU the kill can beat the send and the
        # resume is from step 32 (the race of any asynchronous save, not the
        # resume this test is about).
        backup.manager.sync()
        shutil.rmtree(local_dir)  # Its node, and the local copies on it, are gone.
        os.kill(os.getpid(), signal.SIGKILL)

  # What this worker prints (Keras's epoch lines, tfdp's goodput line): the chief's alone.
  with open(os.path.join(attempt_path, str(attempt), "stdout"), "w") as out, \
      contextlib.redirect_stdout(out):
    model.fit(x, y, batch_size=64, epochs=3, shuffle=True, verbose=2,
              callbacks=[backup, tfdp_ray.ReportCheckpoints(backup), Kill()])
  record = {"started": started, "ended": time.time(), "restored_step": backup.restored_step,
            "restored_tier": backup.manager.restored_tier if backup.manager else None}
  with open(os.path.join(attempt_path, str(attempt), "restored.json"), "w") as f:
    json.dump(record, f)
  if rank == 0:
    np.savez(os.path.join(root, "weights.npz"), *model.get_weights())


def run(root, kill):
  os.makedirs(root)
  trainer = TensorflowTrainer(
      train_loop_per_worker, train_loop_config={"root": root, "kill": kill},
      scaling_config=ray.train.ScalingConfig(num_workers=2),
      run_config=ray.train.RunConfig(
          storage_path=root, name="ray",
          failure_config=ray.train.FailureConfig(max_failures=1)))
  result = trainer.fit()
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdp.integrations import ray as tfdp_ray  # pylint: disable=g-import-not-at-top
  with np.load(os.path.join(root, "weights.npz")) as w:
    weights = [w[k].tobytes().hex() for k in sorted(w.files)]
  attempts, printed = {}, {0: [], 1: []}
  for rank in (0, 1):
    path = os.path.join(root, f"attempts-{rank}")
    attempts[rank] = []
    for a in sorted(os.listdir(path), key=int):
      done = os.path.join(path, a, "restored.json")
      attempts[rank].append(json.load(open(done)) if os.path.exists(done) else None)
      with open(os.path.join(path, a, "stdout")) as f:
        printed[rank].append(f.read())
  return {"weights": weights, "attempts": attempts, "metrics": result.metrics,
          "pointer": tfdp_ray.backup_of(result.checkpoint), "printed": printed,
          "goodput": tfdp_ray.goodput_summary(os.path.join(root, "backup"))}


def main(root):
  start = time.time()
  # Ray Train's controller polls its workers every 2 s by default; a worker's
  # next ray.train.report waits until a poll took the previous one (a queue of
  # one), and the end of each run and the SIGKILLed worker wait for a poll to
  # be seen. A shorter period shortens only those waits. Ray hands the setting
  # on to the controller and the workers; a poll unanswered within it still
  # counts as hung only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min).
  os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  out = {"reference": run(os.path.join(root, "reference"), False),
         "killed": run(os.path.join(root, "killed"), True), "started": start,
         "ended": time.time()}
  with open(os.path.join(root, "result.json"), "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(sys.argv[1])
