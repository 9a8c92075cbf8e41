"""Keras 3 multi-worker fit on Ray Train with tfdp: backups, resumes after Ray's restarts, Ray told of each backup.

Usage: python scripts/examples/ray_keras.py [STORAGE_DIR]. Starts (or joins)
a Ray cluster, trains 2 workers; BackupAndRestore's directory must be one
every worker sees (here under STORAGE_DIR, on one machine).
"""

import os
import sys

import ray
import ray.train
from ray.train.tensorflow import TensorflowTrainer


def model_and_data(strategy):
  """A small regression model compiled under `strategy`, and its data."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(1024, 8)).astype("float32")
  y = (x @ rng.normal(size=(8, 1))).astype("float32")
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
  return model, x, y


def train_loop_per_worker(config):
  import tfdp  # pylint: disable=g-import-not-at-top
  from tfdp.integrations import ray as tfdp_ray  # pylint: disable=g-import-not-at-top

  strategy = tfdp.make_strategy()  # Reads the TF_CONFIG Ray set for this worker.
  model, x, y = model_and_data(strategy)
  backup = tfdp.callbacks.BackupAndRestore(
      backup_dir=config["backup_dir"], save_freq=10, delete_checkpoint=False,
      local_checkpoint_every_steps=2)
  model.fit(x, y, batch_size=64, epochs=3,
            callbacks=[backup, tfdp_ray.ReportCheckpoints(backup)], verbose=0)


def main(storage):
  ray.init(num_cpus=2)
  trainer = TensorflowTrainer(
      train_loop_per_worker,
      train_loop_config={"backup_dir": os.path.join(storage, "backup")},
      scaling_config=ray.train.ScalingConfig(num_workers=2),
      run_config=ray.train.RunConfig(
          storage_path=storage, name="tfdp_keras",
          failure_config=ray.train.FailureConfig(max_failures=1)))
  result = trainer.fit()
  print("metrics:", result.metrics)
  from tfdp.integrations import ray as tfdp_ray  # pylint: disable=g-import-not-at-top
  print("newest backup:", tfdp_ray.backup_of(result.checkpoint))
  # Where the wall time of Ray's attempts went: the line the chief printed into Ray's logs.
  print(tfdp_ray.goodput_summary(os.path.join(storage, "backup")))


if __name__ == "__main__":
  main(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tfdp_ray"))
