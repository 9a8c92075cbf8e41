"""A TF-tutorial custom training loop with tfdp.CheckpointManager (built outside the scope, as tutorials do) and its tf.data iterator in the checkpoint.

Usage: custom_loop.py CKPT_DIR OUT_NPZ. Trains 40 steps of a small MLP under
tfdp.make_strategy(), saving every 10 steps; env TFDP_CKPT_TEST_CRASH_AT
(tests/workers/ckpt_worker.py) kills a worker inside a save, and
TFDP_TEST_SLOW_FROM=N sleeps after each step from N on. Writes the final
weights to OUT_NPZ (the chief).
"""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdp

import ckpt_worker  # tests/workers/

STEPS, EVERY, BATCH = 40, 10, 32


def main(ckpt_dir, out):
  ckpt_worker.install_crash_hook()
  tf.config.experimental.enable_op_determinism()
  strategy = tfdp.make_strategy()
  keras.utils.set_random_seed(3)
  rng = np.random.default_rng(3)
  x = rng.normal(size=(512, 8)).astype("float32")
  y = (x @ rng.normal(size=(8, 1))).astype("float32")
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
  state = tfdp.TrainState(model, optimizer)
  # The tutorial's pipeline; its iterator is saved per worker with the state.
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=3).repeat().batch(BATCH)
  dist = iter(tfdp.data.checkpointable(dataset, strategy))
  manager = tfdp.CheckpointManager(state.checkpoint, ckpt_dir, max_to_keep=2,
                                   per_worker={"data": dist})
  manager.restore_or_initialize()
  start = state.step

  @tf.function
  def train_step(batch):
    def step_fn(features, labels):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(keras.losses.mean_squared_error(labels, model(features, training=True)))
        loss = loss / BATCH
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply(grads, model.trainable_variables)
    strategy.run(step_fn, args=batch)

  slow_from = int(os.environ.get("TFDP_TEST_SLOW_FROM", "-1"))
  for step in range(start + 1, STEPS + 1):
    train_step(next(dist))
    if 0 <= slow_from <= step:
      time.sleep(0.2)
    if step % EVERY == 0:
      manager.save(checkpoint_number=step)
  manager.close()
  if manager.worker_index == 0:
    np.savez(out, *[v.numpy() for v in model.variables + optimizer.variables])
  print(f"custom_loop start={start} step={state.step}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
