"""The data position of a user's tf.data pipeline under plain model.fit: resume cost, state bytes, throughput.

Run through `scripts/bench_resume.py --pipeline=tfrecord [--dp_parts=...]`. The
pipeline is what users write: TFRecord files, interleave, shuffle(10_000),
parse, batch, prefetch, repeated, under plain `model.fit(steps_per_epoch=k)`.

  resume      process start to the end of the first step when resuming at step
              k. tfdp: `tfdp.callbacks.BackupAndRestore` restores the variables
              and the iterator's saved state (its size does not grow with k).
              stock: `tf.train.Checkpoint` restore and `.skip(k)` batches, what a
              user does without tfdp (measured to --stock_max_step, then a line
              through the two largest measured steps, marked projected).
  state       bytes of one worker's iterator state after 100 steps, with and
              without tf.data's symbolic checkpointing.
  throughput  examples/s of `fit` with an async backup every 50 steps holding
              the data position, against plain `fit` and against the same
              backups without the data position
              (TFDP_COMPAT_DISABLE=fit_data_state); interleaved rounds, median.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
if "dp_role" not in FLAGS:
  flags.DEFINE_string("dp_role", None, "internal: make | resume | throughput | state")
  flags.DEFINE_string("dp_variant", None, "internal: tfdp | stock | plain | no_position")
  flags.DEFINE_integer("dp_k", None, "internal: resume step")
  flags.DEFINE_string("dp_dir", None, "internal: work directory")
  flags.DEFINE_string("dp_result", None, "internal: result file")
  flags.DEFINE_integer("dp_records", 20_000, "Records in the TFRecord files.")
  flags.DEFINE_integer("dp_batch", 32, "Global batch size.")
  flags.DEFINE_integer("dp_shuffle", 10_000, "Shuffle buffer.")
  flags.DEFINE_integer("dp_throughput_steps", 600, "Steps per throughput run (100 warm-up).")
  flags.DEFINE_list("dp_parts", ["resume", "state", "throughput"], "Parts to run.")

_FEATURES = 16


def _write_records(directory):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  paths = []
  per_file = FLAGS.dp_records // 4
  for f in range(4):
    path = os.path.join(directory, f"part-{f}.tfrecord")
    paths.append(path)
    with tf.io.TFRecordWriter(path) as w:
      for _ in range(per_file):
        x = rng.normal(size=_FEATURES).astype("float32")
        w.write(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x[0] > 0)])),
        })).SerializeToString())
  return paths


def _dataset(paths, skip=0, symbolic=False):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def parse(record):
    e = tf.io.parse_single_example(record, {"x": tf.io.FixedLenFeature([_FEATURES], tf.float32),
                                            "y": tf.io.FixedLenFeature([], tf.int64)})
    return e["x"], e["y"]

  ds = (tf.data.Dataset.from_tensor_slices(paths).repeat()
        .interleave(tf.data.TFRecordDataset, cycle_length=4)
        .shuffle(FLAGS.dp_shuffle, seed=1).map(parse).batch(FLAGS.dp_batch, drop_remainder=True))
  if skip:
    ds = ds.skip(skip)
  ds = ds.prefetch(2)
  if symbolic:
    options = tf.data.Options()
    options.experimental_symbolic_checkpoint = True
    ds = ds.with_options(options)
  return ds


def _model(steps_per_execution=1):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(2)])
  model.compile(optimizer="adam", steps_per_execution=steps_per_execution,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _paths():
  return sorted(os.path.join(FLAGS.dp_dir, "records", f)
                for f in os.listdir(os.path.join(FLAGS.dp_dir, "records")))


def _make():
  """For every k: a tfdp backup at step k (trained there) and a stock checkpoint of step k."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  paths = _write_records(os.path.join(FLAGS.dp_dir, "records"))
  for k in [int(s) for s in FLAGS.steps]:
    # steps_per_execution keeps reaching step 10^5 cheap; the data path is the same.
    model = _model(steps_per_execution=min(k, 1000))
    backup = tfdp.callbacks.BackupAndRestore(os.path.join(FLAGS.dp_dir, f"tfdp-{k}"),
                                             save_freq="epoch", delete_checkpoint=False)
    model.fit(_dataset(paths), epochs=1, steps_per_epoch=k, callbacks=[backup], verbose=0)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(FLAGS.dp_dir, f"stock-{k}", "ckpt"))
    logging.info("made step %d", k)
  with open(FLAGS.dp_result, "w") as f:
    json.dump({"steps": FLAGS.steps}, f)


def _resume():
  stamps = {}
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  stamps["imported"] = time.time()
  k = FLAGS.dp_k

  class FirstStep(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      stamps["restored"] = time.time()  # After BackupAndRestore's on_train_begin.

    def on_train_batch_end(self, batch, logs=None):
      stamps.setdefault("first_step", time.time())

  model = _model()
  if FLAGS.dp_variant == "tfdp":
    backup = tfdp.callbacks.BackupAndRestore(os.path.join(FLAGS.dp_dir, f"tfdp-{k}"),
                                             save_freq=False, delete_checkpoint=False)
    model.fit(_dataset(_paths()), epochs=2, steps_per_epoch=k, initial_epoch=0,
              callbacks=[backup, FirstStep(), StopAfterOne()], verbose=0)
  else:
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
        os.path.join(FLAGS.dp_dir, f"stock-{k}", "ckpt")).assert_consumed()
    model.fit(_dataset(_paths(), skip=int(model.optimizer.iterations.numpy())), epochs=1,
              steps_per_epoch=1, callbacks=[FirstStep()], verbose=0)
  stamps["step"] = int(model.optimizer.iterations.numpy())
  if stamps["step"] != k + 1:
    raise RuntimeError(f"expected one step to {k + 1}, got {stamps['step']}")
  with open(FLAGS.dp_result, "w") as f:
    json.dump(stamps, f)


class StopAfterOne:
  """Keras callback: stop after the first step (made lazily: keras is imported late)."""

  def __new__(cls):
    import keras  # pylint: disable=g-import-not-at-top

    class _Stop(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True

    return _Stop()


def _state():
  """Iterator-state bytes after 100 steps: no strategy and Mirrored, with and without symbolic."""
  import tfdp  # pylint: disable=g-import-not-at-top
  from tfdp.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  strategy_lib.configure_cpu_replicas(2)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  strategies = {"no strategy": None,
                "MirroredStrategy (1 device)": tf.distribute.MirroredStrategy(["/cpu:0"]),
                "MirroredStrategy (2 devices)": tf.distribute.MirroredStrategy(
                    ["/cpu:0", "/cpu:1"])}

  def images(symbolic):
    # Image batches and nothing else buffered but prefetch: what symbolic saves.
    ds = tf.data.Dataset.range(10**6).map(
        lambda i: tf.fill([32, 32, 3], tf.cast(i, tf.float32))).batch(64).prefetch(2)
    options = tf.data.Options()
    options.experimental_symbolic_checkpoint = symbolic
    return ds.with_options(options)

  pipelines = {"tfrecord+shuffle": lambda symbolic: _dataset(_paths(), symbolic=symbolic),
               "images+prefetch(2)": images}
  for pipeline, make in pipelines.items():
    for name, strategy in strategies.items():
      for symbolic in (False, True):
        dist = tfdp.data.checkpointable(make(symbolic), strategy or tf.distribute.get_strategy())
        it = iter(dist)
        for _ in range(100):
          next(it)
        time.sleep(0.2)  # Let prefetch fill.
        key = f"{pipeline}, {name}, symbolic={symbolic}"
        try:
          out[key] = len(it.state())
        except tfdp.errors.CheckpointError as e:
          found = re.search(r"\w+ does not support symbolic checkpointing", str(e))
          out[key] = "refused: " + (found.group(0) if found else str(e))
  with open(FLAGS.dp_result, "w") as f:
    json.dump(out, f)


def _throughput():
  import keras  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  # Steps of tens of ms, as in training (a 1 ms step is all checkpoint overhead).
  model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(2)])
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  stamps = bench_common.step_stamps_callback()
  callbacks = [stamps]
  if FLAGS.dp_variant != "plain":
    backup_dir = tempfile.mkdtemp(prefix="tfdp_bench_dp_")
    callbacks.insert(0, tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=50,
                                                        async_save=True))
  model.fit(_dataset(_paths()), epochs=1, steps_per_epoch=FLAGS.dp_throughput_steps,
            callbacks=callbacks, verbose=0)
  rates = bench_common.window_rates(stamps.stamps, FLAGS.dp_batch, 100, 100)
  with open(FLAGS.dp_result, "w") as f:
    json.dump({"rates": rates}, f)


def _child(args, result, log, env=None):
  cmd = [sys.executable, os.path.abspath(__file__), f"--dp_result={result}",
         f"--dp_records={FLAGS.dp_records}", f"--dp_batch={FLAGS.dp_batch}",
         f"--dp_shuffle={FLAGS.dp_shuffle}",
         f"--dp_throughput_steps={FLAGS.dp_throughput_steps}"] + args
  t0 = time.time()
  code = subprocess.call(cmd, env=bench_common.worker_env(env), stdout=log,
                         stderr=subprocess.STDOUT)
  if code != 0:
    raise RuntimeError(f"{' '.join(args)} failed (exit {code}); see {log.name}")
  with open(result) as f:
    return t0, json.load(f)


def run(steps, rounds, stock_max, throughput_rounds):
  """The three parts; returns the JSON-able results (and prints tables)."""
  base = tempfile.mkdtemp(prefix="tfdp_bench_dp_")
  log = open(os.path.join(base, "log.txt"), "w")  # pylint: disable=consider-using-with
  out = {"pipeline": "TFRecord x4, interleave(4), shuffle(%d), parse, batch(%d), prefetch(2), "
                     "repeat" % (FLAGS.dp_shuffle, FLAGS.dp_batch)}
  try:
    _child(["--dp_role=make", f"--dp_dir={base}", "--steps=" + ",".join(
        map(str, steps if "resume" in FLAGS.dp_parts else [10]))],
           os.path.join(base, "make.json"), log)
    if "resume" in FLAGS.dp_parts:
      out["resume"] = _resume_part(base, log, steps, rounds, stock_max)
    if "state" in FLAGS.dp_parts:
      _, state = _child(["--dp_role=state", f"--dp_dir={base}"],
                        os.path.join(base, "state.json"), log)
      out["state_bytes"] = state
      print("iterator state after 100 steps: " + json.dumps(state))
    if "throughput" in FLAGS.dp_parts:
      out["throughput"] = _throughput_part(base, log, throughput_rounds)
  finally:
    log.close()
    shutil.rmtree(base, ignore_errors=True)
  return out


def _resume_part(base, log, steps, rounds, stock_max):
  """Process start to first step at each k, tfdp vs stock (interleaved rounds, medians)."""
  runs = [("tfdp", k) for k in steps] + [("stock", k) for k in steps if k <= stock_max]
  samples = {r: [] for r in runs}
  for rnd in range(rounds):
    for variant, k in runs[rnd % len(runs):] + runs[:rnd % len(runs)]:
      t0, s = _child(["--dp_role=resume", f"--dp_variant={variant}", f"--dp_k={k}",
                      f"--dp_dir={base}"], os.path.join(base, f"r-{variant}-{k}-{rnd}.json"),
                     log)
      samples[(variant, k)].append({"to_first_step_s": s["first_step"] - t0,
                                    "after_imports_s": s["first_step"] - s["imported"],
                                    "restore_s": s["restored"] - s["imported"]})
  rows = bench_common.resume_rows(samples, steps, stock_max)
  ratios = {}
  for variant in ("tfdp", "stock"):
    ts = [r for r in rows if r["variant"] == variant]
    if len(ts) >= 2:
      ratios[variant] = ts[-1]["to_first_step_s"] / ts[0]["to_first_step_s"]
  result = {"rows": rows, "ratio_largest_vs_smallest": ratios,
            "target": {"max": 1.2, "met": ratios.get("tfdp", 99) <= 1.2}}
  print(bench_common.table(rows, [
      ("variant", "variant", None), ("step", "resume step", "{:,}"),
      ("to_first_step_s", "start to 1st step s", "{:.2f}"),
      ("after_imports_s", "after imports s", "{:.2f}"),
      ("restore_s", "to restored s", "{:.2f}"), ("projected", "projected", None)]))
  print(f"resume largest/smallest: {ratios} (tfdp target <= 1.2)")
  return result


def _throughput_part(base, log, throughput_rounds):
  """fit examples/s: plain, backups with the data position, backups without (interleaved)."""
  rates = {"plain": [], "tfdp": [], "no_position": []}
  order = list(rates)
  for rnd in range(throughput_rounds):
    for variant in order[rnd % 3:] + order[:rnd % 3]:
      env = {"TFDP_COMPAT_DISABLE": "fit_data_state"} if variant == "no_position" else None
      _, r = _child(["--dp_role=throughput", f"--dp_variant={variant}", f"--dp_dir={base}"],
                    os.path.join(base, f"t-{variant}-{rnd}.json"), log, env=env)
      rates[variant].append(bench_common.median(r["rates"]))
  med = {v: bench_common.median(rs) for v, rs in rates.items()}
  result = {
      "shuffle_buffer": FLAGS.dp_shuffle, "examples_per_s": med, "runs": rates,
      "ratio_vs_plain": med["tfdp"] / med["plain"],
      "ratio_vs_backups_without_position": med["tfdp"] / med["no_position"],
      "target": {"min": 0.97, "met": med["tfdp"] / med["plain"] >= 0.97}}
  print(f"fit examples/s (median of {throughput_rounds} runs, shuffle({FLAGS.dp_shuffle})): "
        f"{med}; tfdp/plain {result['ratio_vs_plain']:.3f} (target >= 0.97), tfdp/backups "
        f"without the data position {result['ratio_vs_backups_without_position']:.3f}")
  return result


def main(argv):
  del argv
  role = {"make": _make, "resume": _resume, "state": _state, "throughput": _throughput}
  role[FLAGS.dp_role]()


if __name__ == "__main__":
  if "steps" not in FLAGS:
    flags.DEFINE_list("steps", None, "internal: steps to make")
  app.run(main)
