"""A plain Keras script on a TFRecord pipeline, converted to tfdp as the README says.

Usage: data_resume.py OUT_ROOT MODES [CPU_REPLICAS]. MODES: comma-separated,
each trained in turn into OUT_ROOT/MODE: `repeat` (a repeated
dataset with steps_per_epoch: one iterator across epochs), `finite` (a new
iterator each epoch, unknown cardinality), `arrays` (numpy arrays straight
to fit), `data` (auto-shard policy DATA instead of FILE) or `source` (a
tfdp.data source, tfdp.data.distribute, under plain fit). The pipeline is
TFRecord files, interleave, shuffle(buffer, seed), a map with stateless
augmentation, batch and prefetch; the model has dropout; TF op determinism
is on. `plain` is `finite` without a strategy (the default one), in a process
that also trains distributed modes; list it first (see TFDP_TEST_CHAIN).

Env TFDP_TEST_KILL_AT=N: the process SIGKILLs itself after global step N (on
worker TFDP_TEST_KILL_WORKER, default every worker; TFDP_TEST_KILL_DELAY
seconds later), having deleted its local tier first with
TFDP_TEST_WIPE_LOCAL=1 (a replaced host); TFDP_TEST_ASYNC=1 saves in the
background; TFDP_TEST_LOCAL_EVERY=N adds a local tier. Each of these set as
NAME_MODE (e.g. TFDP_TEST_KILL_AT_REPEAT) applies to that mode only, so that
one process can train several modes with other settings. With
TFDP_TEST_CHAIN=1, every mode but the last stops at its kill step (every
worker) and trains the next mode there, inside its callback; the last one is
SIGKILLed as above. So one kill leaves every mode of the process mid-run at
its own step, and the same modes run again resume each of them (a mode
without a strategy must come first: the others run inside its fit).
CPU_REPLICAS 1 without TF_CONFIG: no strategy. Writes each worker's final
weights to OUT_ROOT/MODE/weights-<worker>.npy.
"""

import os
import shutil
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf
import tfdp

NUM_FILES = 4
PER_FILE = 48
BATCH = 16


def write_records(data_dir):
  """The dataset's files (written once; a concurrent writer's rename wins)."""
  os.makedirs(data_dir, exist_ok=True)
  paths = []
  for f in range(NUM_FILES):
    path = os.path.join(data_dir, f"part-{f}.tfrecord")
    paths.append(path)
    if os.path.exists(path):
      continue
    rng = np.random.default_rng(f)
    tmp = f"{path}.tmp{os.getpid()}"
    with tf.io.TFRecordWriter(tmp) as w:
      for _ in range(PER_FILE):
        x = rng.normal(size=8).astype("float32")
        w.write(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x.sum() > 0)])),
        })).SerializeToString())
    os.replace(tmp, path)
  return paths


def setting(name, mode):
  """Env NAME_MODE for `mode`, else NAME (None if neither is set)."""
  return os.environ.get(f"{name}_{mode.upper()}", os.environ.get(name))


def parse(record):
  e = tf.io.parse_single_example(record, {"x": tf.io.FixedLenFeature([8], tf.float32),
                                          "y": tf.io.FixedLenFeature([], tf.int64)})
  return e["x"], e["y"]


def augment(x, y):
  seed = tf.stack([tf.cast(tf.reduce_sum(tf.abs(x)) * 1000, tf.int32), 1])
  return x + 0.1 * tf.random.stateless_normal([8], seed=seed), y


def make_dataset(paths, mode):
  ds = tf.data.Dataset.from_tensor_slices(paths).interleave(
      tf.data.TFRecordDataset, cycle_length=2)
  ds = ds.map(parse).shuffle(64, seed=3).map(augment).batch(BATCH)
  if mode == "repeat":
    ds = ds.repeat()
  if mode == "data":
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)
  return ds.prefetch(2)


class KillAt(keras.callbacks.Callback):
  """SIGKILLs this process after global step $TFDP_TEST_KILL_AT (after its callbacks' saves).

  In a chain (TFDP_TEST_CHAIN=1), `then` is the next mode's training, which
  every worker runs there instead.
  """

  def __init__(self, worker, mode, backup_dir, then=None):
    super().__init__()
    self.worker = worker
    self.mode = mode
    self.backup_dir = backup_dir
    self.then = then

  def on_train_batch_end(self, batch, logs=None):
    at = int(setting("TFDP_TEST_KILL_AT", self.mode) or "-1")
    if at != int(self.model.optimizer.iterations.numpy()):
      return
    if self.then:
      print(f"CHAIN mode={self.mode} stopped at step {at}", flush=True)
      self.then()
      raise AssertionError(f"the mode after {self.mode} returned instead of being killed")
    who = os.environ.get("TFDP_TEST_KILL_WORKER")
    if who in (None, str(self.worker)):
      # A moment later: the background local save of the step before has landed.
      time.sleep(float(setting("TFDP_TEST_KILL_DELAY", self.mode) or "0"))
      if os.environ.get("TFDP_TEST_WIPE_LOCAL") == "1":  # this host's RAM tier is gone
        from tfdp.checkpoint.format import layout  # pylint: disable=g-import-not-at-top
        shutil.rmtree(layout.local_worker_dir(layout.default_local_root(self.backup_dir),
                                              self.worker))
      os.kill(os.getpid(), signal.SIGKILL)


def train(out_dir, name, strategy, worker, then=None):
  """Trains mode `name` into out_dir; `then`: the rest of a chain (see KillAt)."""
  mode = name
  if name == "plain":
    strategy, mode = tf.distribute.get_strategy(), "finite"
  keras.utils.set_random_seed(7)
  paths = write_records(os.path.join(os.path.dirname(out_dir), "records"))
  with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(2)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  local_every = setting("TFDP_TEST_LOCAL_EVERY", name)
  backup_dir = os.path.join(out_dir, "backup")
  backup = tfdp.callbacks.BackupAndRestore(
      backup_dir, save_freq=3,
      async_save=setting("TFDP_TEST_ASYNC", name) == "1",
      local_checkpoint_every_steps=int(local_every) if local_every else None)
  callbacks = [backup, KillAt(worker, name, backup_dir, then)]
  if mode in ("arrays", "source"):
    x, y = zip(*make_dataset(paths, "finite").unbatch().as_numpy_iterator())
    x, y = np.stack(x), np.array(y)
  if mode == "arrays":
    model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=callbacks, verbose=0)
  elif mode == "source":
    dist = tfdp.data.distribute(strategy, tfdp.data.ArraySource((x, y)),
                                global_batch_size=BATCH, seed=3)
    model.fit(dist, epochs=3, steps_per_epoch=len(x) // BATCH, callbacks=callbacks, verbose=0)
  else:
    kwargs = {"steps_per_epoch": 5} if mode == "repeat" else {}
    model.fit(make_dataset(paths, mode), epochs=3, callbacks=callbacks, verbose=0, **kwargs)
  np.save(os.path.join(out_dir, f"weights-{worker}.npy"),
          np.concatenate([w.numpy().ravel() for w in model.weights]))
  print(f"RESULT mode={name} worker={worker} steps={int(model.optimizer.iterations.numpy())} "
        f"restored={backup.restored_step}", flush=True)


def main(out_root, modes, cpu_replicas=1):
  strategy = tfdp.make_strategy(cpu_replicas=int(cpu_replicas))
  tf.config.experimental.enable_op_determinism()
  worker = tfdp.cluster.resolve(strategy).index
  modes = modes.split(",")
  chain = os.environ.get("TFDP_TEST_CHAIN") == "1"

  def run(i):
    train(os.path.join(out_root, modes[i]), modes[i], strategy, worker,
          then=(lambda: run(i + 1)) if chain and i + 1 < len(modes) else None)

  if chain:
    run(0)
    raise AssertionError(f"mode {modes[0]} ended before its kill step")
  for i in range(len(modes)):
    run(i)


if __name__ == "__main__":
  main(*sys.argv[1:])
