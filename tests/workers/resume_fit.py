"""A plain Keras training script made exactly resumable with tfdp.callbacks.BackupAndRestore + tfdp.fit.

Usage: resume_fit.py BACKUP_DIR STRATEGY [REFERENCE_DIR]. Env
TFDP_TEST_SLOW_FROM=N sleeps after each step from global step N on, so a
test can kill it mid-epoch. With REFERENCE_DIR the same process then trains
once more from scratch, backed up there: an uninterrupted reference without
a process of its own (starting TensorFlow is most of a run's time).
"""

import sys

import keras
import tensorflow as tf

import tfdp

from models import cnn
import slow_steps  # tests/workers/


def train(strategy, backup_dir):
  """The script's training, backed up in `backup_dir`; prints what it restored and reached."""
  keras.utils.set_random_seed(1)
  source = tfdp.data.synthetic_images(num_examples=256, image_shape=(8, 8, 3), seed=1)
  with strategy.scope():
    model = cnn.build(input_shape=(8, 8, 3), seed=1)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  backup = tfdp.callbacks.BackupAndRestore(
      backup_dir, save_freq=5, delete_checkpoint=False,
      run_config={"global_batch_size": 16, "dataset": source.name, "seed": 1})
  # The one change from plain Keras: model.fit(dataset, ...) becomes
  # tfdp.fit(model, make_dataset, ...), so the data starts where the backup is.
  tfdp.fit(model,
           lambda step: tfdp.data.distribute(strategy, source, global_batch_size=16,
                                             seed=1, start_step=step),
           epochs=5, steps_per_epoch=8, callbacks=[backup, slow_steps.SlowFrom()], verbose=0)
  print(f"restored_step={backup.restored_step} final_step="
        f"{int(model.optimizer.iterations.numpy())}", flush=True)


def main(backup_dir, kind, reference_dir=None):
  strategy = tfdp.make_strategy(kind, cpu_replicas=2 if kind == "mirrored" else None)
  tf.config.experimental.enable_op_determinism()
  train(strategy, backup_dir)
  if reference_dir:
    keras.backend.clear_session()  # the model as a fresh process builds it
    train(strategy, reference_dir)


if __name__ == "__main__":
  main(*sys.argv[1:])
