"""Resume benchmark: process start to first training step when resuming at step 10, 10^4, 10^6."""

# The checkpoints are built cheaply: a TrainState (tfdp) or a
# tf.train.Checkpoint of model + optimizer (stock) whose optimizer iteration
# is set to k, without training k steps. Each resume is a fresh Python process;
# its time runs from just before the parent starts it to the end of its first
# training step, and it reports the phases (imports, restore, data, first
# step). The (variant, k) runs are interleaved in rotated rounds; each figure
# is the median over rounds.
#
#   tfdp   CheckpointManager.restore (verified) of a TrainState, then tfdp.fit
#          from the restored step on tfdp.data.distribute(start_step=k): the
#          data position is computed, not replayed.
#   stock  tf.train.Checkpoint restore, then the pipeline a user would write
#          (from_tensor_slices/shuffle/repeat/batch) with .skip(k) to reach the
#          same data position, then model.fit. Its cost grows with k, so by
#          default it runs only up to --stock_max_step and the rest is a linear
#          projection from the measured steps (marked "projected").

import json
import os
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
import bench_data_position  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "One round (CI, < 2 min on 2 cores).")
flags.DEFINE_bool("smoke", False, "Steps 10 and 10^6 (tfdp) and 10 (stock), one round (tests).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_enum("pipeline", "arrays", ["arrays", "tfrecord"],
                  "arrays: tfdp.fit + tfdp.data (below); tfrecord: a user's TFRecord + "
                  "shuffle(10_000) pipeline under plain model.fit with the data position in "
                  "the backup (scripts/bench_data_position.py; also state bytes, throughput).")
flags.DEFINE_integer("throughput_rounds", None, "tfrecord: throughput runs per variant "
                     "(default 1 smoke/quick, 5 full).")
flags.DEFINE_list("steps", None, "Resume steps (default 10,10000,1000000).")
flags.DEFINE_integer("rounds", None, "Rounds over the (variant, step) runs (default 1 quick, 5 full).")
flags.DEFINE_integer("stock_max_step", 10000,
                     "Largest step the stock variant runs at (skip() costs O(step)); "
                     "larger steps are projected linearly.")
flags.DEFINE_string("model", "cnn", "models registry name.")
flags.DEFINE_integer("global_batch_size", 32, "Global batch.")
flags.DEFINE_integer("num_examples", 2048, "Examples held in memory (32x32x3 images).")
flags.DEFINE_float("max_load", 1.5, "Wait (up to --wait_quiet_s) for the 1-min load to drop below this.")
flags.DEFINE_float("wait_quiet_s", 0.0, "Longest wait for a quiet machine before measuring.")
# Internal.
flags.DEFINE_string("role", None, "internal: make | resume")
flags.DEFINE_string("variant", None, "internal: tfdp | stock")
flags.DEFINE_integer("k", None, "internal: resume step")
flags.DEFINE_string("dir", None, "internal: checkpoint root")
flags.DEFINE_string("result", None, "internal: result file")

_SEED = 0


def _arrays():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(_SEED)
  x = rng.standard_normal((FLAGS.num_examples, 32, 32, 3), dtype=np.float32)
  y = rng.integers(0, 10, FLAGS.num_examples).astype(np.int32)
  return x, y


def _model():
  import keras  # pylint: disable=g-import-not-at-top
  bench_common.ensure_repo_on_path()
  import models  # pylint: disable=g-import-not-at-top
  model = models.get(FLAGS.model).build(input_shape=(32, 32, 3), num_classes=10, seed=_SEED)
  model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _run_config():
  return {"model": FLAGS.model, "dataset": "bench_resume", "seed": _SEED,
          "global_batch_size": FLAGS.global_batch_size}


def _make(steps):
  """Writes, for every k, a tfdp checkpoint and a stock one whose step is k."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  model = _model()
  state = tfdp.TrainState(model, run_config=_run_config())
  for k in steps:
    state.optimizer.iterations.assign(k)
    manager = tfdp.CheckpointManager(state.checkpoint, os.path.join(FLAGS.dir, f"tfdp-{k}"),
                                     max_to_keep=1)
    manager.save(checkpoint_number=k)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(FLAGS.dir, f"stock-{k}", "ckpt"))


def _resume():
  """One resume; writes wall-clock stamps (time.time()) of its phases."""
  stamps = {"imported": None}
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  stamps["imported"] = time.time()
  g = FLAGS.global_batch_size
  x, y = _arrays()
  spe = tfdp.data.steps_per_epoch(len(x), g)

  class FirstStep(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if "first_step" not in stamps:
        stamps["first_step"] = time.time()

  strategy = tfdp.make_strategy("default")
  with strategy.scope():
    model = _model()
  if FLAGS.variant == "tfdp":
    with strategy.scope():
      state = tfdp.TrainState(model, run_config=_run_config())
    manager = tfdp.CheckpointManager(state.checkpoint,
                                     os.path.join(FLAGS.dir, f"tfdp-{FLAGS.k}"))
    with strategy.scope():
      manager.restore(manager.latest_checkpoint)
    start = state.step
    stamps["restored"] = time.time()
    source = tfdp.data.ArraySource((x, y), name="bench_resume")

    def make_dataset(first_step):
      ds = tfdp.data.distribute(strategy, source, global_batch_size=g, seed=_SEED,
                                start_step=first_step)
      stamps["data"] = time.time()
      return ds

    tfdp.fit(model, make_dataset, start_step=start, train_steps=start + 1,
             steps_per_epoch=spe, callbacks=[FirstStep()], verbose=0)
  else:
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
        os.path.join(FLAGS.dir, f"stock-{FLAGS.k}", "ckpt")).assert_consumed()
    start = int(model.optimizer.iterations.numpy())
    stamps["restored"] = time.time()
    ds = (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(len(x), seed=_SEED, reshuffle_each_iteration=True).repeat()
          .batch(g, drop_remainder=True).skip(start).prefetch(tf.data.AUTOTUNE))
    stamps["data"] = time.time()
    model.fit(ds, epochs=1, steps_per_epoch=1, callbacks=[FirstStep()], verbose=0)
  stamps["step"] = int(model.optimizer.iterations.numpy())
  if stamps["step"] != start + 1:
    raise RuntimeError(f"resumed at {start}, expected one step to {start + 1}, "
                       f"got {stamps['step']}")
  stamps["start_step"] = start
  with open(FLAGS.result, "w") as f:
    json.dump(stamps, f)


def _child(args, result, log):
  cmd = [sys.executable, os.path.abspath(__file__), f"--result={result}",
         f"--model={FLAGS.model}", f"--global_batch_size={FLAGS.global_batch_size}",
         f"--num_examples={FLAGS.num_examples}"] + args
  t0 = time.time()
  code = subprocess.call(cmd, env=bench_common.worker_env(), stdout=log,
                         stderr=subprocess.STDOUT)
  if code != 0:
    raise RuntimeError(f"{' '.join(args)} failed (exit {code}); see {log.name}")
  if not os.path.exists(result):
    return t0, None
  with open(result) as f:
    return t0, json.load(f)


def _settings():
  if FLAGS.smoke:
    steps, rounds, stock_max = [10, 10**6], 1, 10
  elif FLAGS.quick:
    steps, rounds, stock_max = [10, 10**4, 10**6], 1, FLAGS.stock_max_step
  else:
    steps, rounds, stock_max = [10, 10**4, 10**6], 5, FLAGS.stock_max_step
  if FLAGS.steps:
    steps = [int(float(s)) for s in FLAGS.steps]
  if FLAGS.rounds:
    rounds = FLAGS.rounds
  return sorted(steps), rounds, stock_max


def _data_position():
  if FLAGS.smoke:
    steps, rounds, stock_max, t_rounds = [10, 100], 1, 10, 1
    FLAGS.dp_records, FLAGS.dp_shuffle, FLAGS.dp_throughput_steps = 2000, 1000, 300
  else:
    steps = [int(float(s)) for s in FLAGS.steps] if FLAGS.steps else [10, 10**4, 10**5]
    rounds = FLAGS.rounds or (1 if FLAGS.quick else 5)
    stock_max, t_rounds = FLAGS.stock_max_step, 1 if FLAGS.quick else 5
  t_rounds = FLAGS.throughput_rounds or t_rounds
  load = bench_common.wait_for_quiet(FLAGS.max_load, FLAGS.wait_quiet_s, log=logging.info)
  out = {"machine": bench_common.machine(), "command": " ".join(sys.argv), "steps": steps,
         "rounds": rounds, "load_before": load}
  out.update(bench_data_position.run(sorted(steps), rounds, stock_max, t_rounds))
  out["load_after"] = bench_common.load_average()
  print(f"load average: before {load}, after {out['load_after']}")
  bench_common.write_json(FLAGS.out, out)


def main(argv):
  del argv
  if FLAGS.role == "make":
    _make([int(s) for s in FLAGS.steps])
    return
  if FLAGS.role == "resume":
    _resume()
    return
  if FLAGS.pipeline == "tfrecord":
    _data_position()
    return
  steps, rounds, stock_max = _settings()
  load = bench_common.wait_for_quiet(FLAGS.max_load, FLAGS.wait_quiet_s, log=logging.info)
  out = {"machine": bench_common.machine(), "quick": FLAGS.quick, "smoke": FLAGS.smoke,
         "command": " ".join(sys.argv), "steps": steps, "rounds": rounds,
         "load_before": load}
  base = tempfile.mkdtemp(prefix="tfdp_bench_resume_")
  log_path = os.path.join(base, "log.txt")
  log = open(log_path, "w")  # pylint: disable=consider-using-with
  try:
    _child(["--role=make", f"--dir={base}", "--steps=" + ",".join(map(str, steps))],
           os.path.join(base, "make.json"), log)
    runs = [("tfdp", k) for k in steps] + [("stock", k) for k in steps if k <= stock_max]
    samples = {r: [] for r in runs}
    for rnd in range(rounds):
      order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
      for variant, k in order:
        result = os.path.join(base, f"r-{variant}-{k}-{rnd}.json")
        t0, s = _child(["--role=resume", f"--variant={variant}", f"--k={k}",
                        f"--dir={base}"], result, log)
        samples[(variant, k)].append({
            "to_first_step_s": s["first_step"] - t0,
            "imports_s": s["imported"] - t0,
            "restore_s": s["restored"] - s["imported"],
            "data_s": s["data"] - s["restored"],
            "first_step_s": s["first_step"] - s["data"],
            "after_imports_s": s["first_step"] - s["imported"]})
      logging.info("round %d done", rnd)
  finally:
    log.close()
  rows = bench_common.resume_rows(samples, steps, stock_max)
  ratios, ratios_after_imports = {}, {}
  for variant in ("tfdp", "stock"):
    ts = [r for r in rows if r["variant"] == variant]
    if len(ts) >= 2:
      ratios[variant] = ts[-1]["to_first_step_s"] / ts[0]["to_first_step_s"]
      if "after_imports_s" in ts[-1]:
        # Imports come before the step is known: their noise is not resume cost.
        ratios_after_imports[variant] = (ts[-1]["after_imports_s"]
                                         / ts[0]["after_imports_s"])
  out.update(rows=rows, ratio_largest_vs_smallest=ratios,
             ratio_after_imports=ratios_after_imports,
             samples={f"{v}-{k}": ss for (v, k), ss in samples.items()},
             target={"ratio": ratios.get("tfdp"), "max": 1.5,
                     "met": ratios.get("tfdp", 99) <= 1.5},
             load_after=bench_common.load_average())
  print(bench_common.table(rows, [
      ("variant", "variant", None), ("step", "resume step", "{:,}"),
      ("to_first_step_s", "start to 1st step s", "{:.2f}"),
      ("imports_s", "imports s", "{:.2f}"),
      ("after_imports_s", "after imports s", "{:.2f}"),
      ("restore_s", "build+restore s", "{:.2f}"),
      ("data_s", "data s", "{:.3f}"), ("first_step_s", "1st step s", "{:.2f}"),
      ("projected", "projected", None)]))
  print(f"largest/smallest, after imports: {ratios_after_imports}")
  print(f"largest/smallest: {ratios} (tfdp target <= 1.5: "
        f"{'MET' if out['target']['met'] else 'MISSED'})")
  print(f"load average: before {load}, after {out['load_after']}")
  bench_common.write_json(FLAGS.out, out)
  shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
