"""Training benchmark: tfdp vs plain Keras fit, RING all-reduce vs raw TCP, 1 vs 2 workers."""

# Four parts, each in fresh processes (TF's devices and threads are fixed at
# start), each measuring ratios inside one run so that a busy machine slows
# the compared variants alike:
#
# * throughput: one process, one strategy (default: MirroredStrategy over 2
#   logical CPUs), one model per variant built from the same seed. Variants run
#   in rounds, the order rotated every round; each call runs warm-up steps then
#   timed windows; a variant's rate is the median of its windows' examples/s.
#     plain       model.fit on strategy.experimental_distribute_dataset of a
#                 from_tensor_slices/shuffle/repeat/batch/prefetch pipeline.
#     plain_ckpt  plain + keras.callbacks.BackupAndRestore(save_freq=N) (the
#                 stock way to checkpoint a Keras run; synchronous).
#     tfdp        tfdp.fit + tfdp.data.distribute over the same arrays.
#     tfdp_ckpt   tfdp + async tfdp.CheckpointManager every N steps
#                 (tfdp.callbacks.CheckpointEvery); each timed window holds
#                 exactly one save.
# * allreduce: 2 workers on localhost (tfdp-launch), MultiWorkerMirroredStrategy
#   with RING; all-reduce of a gradient list of S bytes (32 tensors of mixed
#   sizes) for each bytes_per_pack, interleaved; against raw loopback TCP
#   bandwidth (Python sockets, one direction and both directions at once)
#   measured by this process just before and after.
# * overlap: the gradient path's buckets and compression against the user's
#   own MultiWorkerMirroredStrategy, 2 workers each pinned to a core; the
#   all-reduce alone (T_comm) and one worker alone (T_comp) in the same run
#   (scripts/bench_overlap.py says how).
# * scaling: 1 vs 2 workers (tfdp.fit under MultiWorkerMirroredStrategy), each
#   pinned to its own core with one intra-op thread, the same per-worker batch (weak scaling);
#   efficiency = rate(2) / (2 * rate(1)); "predicted" is the alpha-beta check:
#   one worker's step time plus the all-reduce time of the model's gradients
#   interpolated from the allreduce part (when it ran in the same invocation).
#
# The plain variants run in a process that imported tfdp, so tfdp.compat's
# Keras patches are active for them too (they only change multi-worker paths).

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position
import bench_overlap  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Fewer rounds, windows and sizes (CI, < 2 min on 2 cores).")
flags.DEFINE_bool("smoke", False, "Tiny everything: only checks that each part runs (tests).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_list("parts", ["throughput", "allreduce", "scaling"],
                  "Parts to run: throughput, allreduce, scaling, overlap.")
flags.DEFINE_list("variants", ["plain", "tfdp", "plain_ckpt", "tfdp_ckpt"],
                  "Throughput variants (see the module docstring).")
flags.DEFINE_string("model", "mlp", "mlp (bench-local, 4.2M params), or a models "
                    "registry name (cnn, resnet20, resnet50, keras_app:ResNet50, ...).")
flags.DEFINE_integer("image_size", 32, "Side of the synthetic images.")
flags.DEFINE_integer("num_classes", 10, "Classes of the synthetic labels.")
flags.DEFINE_integer("num_examples", 2048, "Examples held in memory.")
flags.DEFINE_integer("global_batch_size", 64, "Global batch of the throughput part.")
flags.DEFINE_string("strategy", "mirrored", "tfdp.make_strategy kind of the throughput part.")
flags.DEFINE_integer("cpu_replicas", 2, "Logical CPU replicas of the throughput part.")
flags.DEFINE_bool("mixed_precision", False, "mixed_float16 policy (GPU).")
flags.DEFINE_integer("ckpt_every", 50, "Checkpoint period in steps (the *_ckpt variants).")
flags.DEFINE_integer("warmup_steps", None, "Steps per call left out of timing.")
flags.DEFINE_integer("window_steps", None, "Steps per timed window (default ckpt_every).")
flags.DEFINE_integer("windows", None, "Timed windows per call.")
flags.DEFINE_integer("rounds", None, "Rounds over the variants (order rotated).")
flags.DEFINE_list("sizes_mb", None, "All-reduce sizes in MB.")
flags.DEFINE_list("packs_mb", None, "bytes_per_pack values in MB (0 = TF's default: one pack).")
flags.DEFINE_integer("reps", None, "All-reduce repetitions per (size, pack).")
flags.DEFINE_integer("scaling_batch", 32, "Per-worker batch of the scaling part.")
flags.DEFINE_list("scaling_models", ["mlp", "resnet20"],
                  "Models of the scaling part: mlp is communication-bound "
                  "(17 MB of gradients), resnet20 compute-bound (1.1 MB).")
flags.DEFINE_list("overlap_models", ["mlp", "resnet20"], "Models of the overlap part.")
flags.DEFINE_enum("overlap_strategy", "own", ["own", "tfdp", "mirrored"],
                  "(internal) overlap job: the user's own MWMS, tfdp.make_strategy() or the user's own MirroredStrategy.")
flags.DEFINE_bool("overlap_mirrored_only", False,
                  "The overlap part's single-process MirroredStrategy jobs only.")
flags.DEFINE_enum("overlap_variants", "all", ["all", "one"],
                  "(internal) overlap job: every variant, or one_pack only.")
flags.DEFINE_float("max_load", 1.5, "Wait (up to --wait_quiet_s) for the 1-min load to drop below this.")
flags.DEFINE_float("wait_quiet_s", 0.0, "Longest wait for a quiet machine before each part.")
# Internal: one benchmark process.
flags.DEFINE_string("role", None, "internal: throughput | allreduce | scaling")
flags.DEFINE_string("result", None, "internal: where a worker writes its result")

_MB = 1 << 20


def _settings():
  """Run sizes of this mode; explicit flags win."""
  if FLAGS.smoke:
    # One window of 2 steps after 1 warm-up step: still one save per timed
    # window (ckpt_every 2) and one window rate per call. Packs of 4 MB, the
    # default, so that the scaling part's alpha-beta prediction runs too.
    d = dict(warmup_steps=1, windows=1, rounds=1, window_steps=2, ckpt_every=2,
             sizes_mb=[1], packs_mb=[0, 4], reps=1, scaling_rounds=1,
             tcp_mb=4, num_examples=256)
  elif FLAGS.quick:
    d = dict(warmup_steps=3, windows=1, rounds=2, window_steps=None,
             ckpt_every=None, sizes_mb=[1, 16], packs_mb=[0, 4], reps=2,
             scaling_rounds=1, tcp_mb=64, num_examples=None)
  else:
    d = dict(warmup_steps=5, windows=2, rounds=8, window_steps=None,
             ckpt_every=None, sizes_mb=[1, 4, 16, 64, 256],
             packs_mb=[0, 1, 4, 16, 32, 64], reps=5, scaling_rounds=2,
             tcp_mb=256, num_examples=None)
  for key in ("warmup_steps", "windows", "rounds", "window_steps", "reps"):
    if getattr(FLAGS, key) is not None:
      d[key] = getattr(FLAGS, key)
  if FLAGS.sizes_mb:
    d["sizes_mb"] = [float(x) for x in FLAGS.sizes_mb]
  if FLAGS.packs_mb:
    d["packs_mb"] = [float(x) for x in FLAGS.packs_mb]
  if d["ckpt_every"] is None or FLAGS["ckpt_every"].present:
    d["ckpt_every"] = FLAGS.ckpt_every
  if d["window_steps"] is None:
    d["window_steps"] = d["ckpt_every"]
  d["num_examples"] = (FLAGS.num_examples if FLAGS["num_examples"].present
                       or d["num_examples"] is None else d["num_examples"])
  return d


# -- models and data (shared by the throughput and scaling parts) --


def _build_model(seed=0):
  import keras  # pylint: disable=g-import-not-at-top
  shape = (FLAGS.image_size, FLAGS.image_size, 3)
  if FLAGS.model == "mlp":
    # Heavy on parameters for its compute: 34 MB of state (weights+momentum)
    # makes checkpoints cost relatively more than for ResNet-50.
    init = lambda i: keras.initializers.GlorotUniform(seed=seed + i)
    inputs = keras.Input(shape=shape, name="image")
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(1024, activation="relu", kernel_initializer=init(1))(x)
    x = keras.layers.Dense(1024, activation="relu", kernel_initializer=init(2))(x)
    outputs = keras.layers.Dense(FLAGS.num_classes, dtype="float32",
                                 kernel_initializer=init(3), name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")
  bench_common.ensure_repo_on_path()
  try:
    import models  # pylint: disable=g-import-not-at-top
    return models.get(FLAGS.model).build(input_shape=shape,
                                         num_classes=FLAGS.num_classes, seed=seed)
  except (ImportError, KeyError):
    if FLAGS.model not in ("resnet50", "keras_app:ResNet50"):
      raise
  base = keras.applications.ResNet50(weights=None, input_shape=shape,
                                     classes=FLAGS.num_classes,
                                     classifier_activation=None)
  logits = keras.layers.Activation("linear", dtype="float32")(base.output)
  return keras.Model(base.inputs, logits)


def _compile(model):
  import keras  # pylint: disable=g-import-not-at-top
  model.compile(
      optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])


def _arrays(num_examples, seed=0):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(
      (num_examples, FLAGS.image_size, FLAGS.image_size, 3), dtype=np.float32)
  y = rng.integers(0, FLAGS.num_classes, num_examples).astype(np.int32)
  return x, y


# -- throughput --


def _throughput_worker(settings):
  """Runs the variants in rotated rounds in this process; writes their window rates."""
  import tfdp  # pylint: disable=g-import-not-at-top
  strategy = tfdp.make_strategy(FLAGS.strategy, cpu_replicas=FLAGS.cpu_replicas)
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")
  g = FLAGS.global_batch_size
  every = settings["ckpt_every"]
  window = settings["window_steps"]
  steps = settings["warmup_steps"] + settings["windows"] * window + 1
  x, y = _arrays(settings["num_examples"])
  scratch = tempfile.mkdtemp(prefix="tfdp_bench_train_ckpt_")

  plain_ds = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y))
      .shuffle(len(x), seed=0, reshuffle_each_iteration=True).repeat()
      .batch(g, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
  source = tfdp.data.ArraySource((x, y), name="bench")

  variants = {}
  for i, name in enumerate(FLAGS.variants):
    with strategy.scope():
      model = _build_model(seed=0)
      _compile(model)
    v = {"model": model, "rates": [], "by_round": [], "extra": []}
    if name == "tfdp_ckpt":
      with strategy.scope():
        state = tfdp.TrainState(model, run_config={"global_batch_size": g})
      v["manager"] = tfdp.CheckpointManager(
          state.checkpoint, os.path.join(scratch, name), max_to_keep=2,
          async_save=True, strategy=strategy, global_batch_size=g)
    variants[name] = v
  state_bytes = sum(int(w.numpy().nbytes) for w in
                    variants[FLAGS.variants[0]]["model"].weights)

  def run(name, v, round_index):
    model = v["model"]
    stamps = bench_common.step_stamps_callback()
    start = int(model.optimizer.iterations.numpy())
    if name.startswith("plain"):
      cbs = []
      if name == "plain_ckpt":
        cbs.append(keras.callbacks.BackupAndRestore(
            os.path.join(scratch, f"{name}-{round_index}"), save_freq=every,
            delete_checkpoint=True))
      model.fit(plain_ds, epochs=1, steps_per_epoch=steps, verbose=0,
                callbacks=cbs + [stamps])
    else:
      cbs = []
      if name == "tfdp_ckpt":
        cbs.append(tfdp.callbacks.CheckpointEvery(v["manager"], every))

      def make_dataset(first_step):
        return tfdp.data.distribute(strategy, source, global_batch_size=g,
                                    seed=0, start_step=first_step)

      # One fit "epoch" per call, so every call is one segment from an epoch
      # start (steady state, as in a run that is not resumed).
      tfdp.fit(model, make_dataset, start_step=start, train_steps=start + steps,
               steps_per_epoch=steps, callbacks=cbs + [stamps], verbose=0)
      if "manager" in v:
        t = time.perf_counter()
        v["manager"].wait_until_finished()
        v["extra"].append(time.perf_counter() - t)
    rates = bench_common.window_rates(stamps.stamps, g, settings["warmup_steps"], window)
    v["rates"].extend(rates)
    v["by_round"].append(rates)

  names = list(variants)
  for r in range(settings["rounds"]):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      run(name, variants[name], r)
    logging.info("round %d: %s", r, {n: round(bench_common.median(variants[n]["rates"]), 1)
                                     for n in names})
  res = {"state_bytes": state_bytes, "replicas": strategy.num_replicas_in_sync,
         "steps_per_call": steps, "variants": {}}
  for name, v in variants.items():
    res["variants"][name] = {
        "median_examples_per_s": bench_common.median(v["rates"]),
        "window_rates": v["rates"],
        "window_rates_by_round": v["by_round"],
        "wait_after_call_s": v["extra"]}
  for v in variants.values():
    if "manager" in v:
      v["manager"].close()
  shutil.rmtree(scratch, ignore_errors=True)
  with open(FLAGS.result, "w") as f:
    json.dump(res, f)


# -- all-reduce --


def _grad_sizes(total_bytes, n=32):
  """Element counts of n float32 tensors of mixed sizes (ratios 1..128) summing to total."""
  weights = [2 ** (i % 8) for i in range(n)]
  elems = total_bytes // 4
  sizes = [max(1, elems * w // sum(weights)) for w in weights]
  sizes[-1] += elems - sum(sizes)
  return sizes


def _allreduce_worker(settings):
  """Each worker: RING all-reduce of every (size, pack), interleaved; worker 0 writes times."""
  import tfdp  # pylint: disable=g-import-not-at-top
  strategy = tfdp.make_strategy("multi_worker", all_reduce="ring")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  impl = tf.distribute.experimental.CommunicationImplementation.RING
  me = tfdp.cluster.resolve(strategy)
  n = me.count

  def make_fn(tensors, options):
    @tf.function
    def fn():
      def replica_fn():
        out = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tensors, options=options)
        return tf.add_n([o[0] for o in out])
      return strategy.run(replica_fn)
    return fn

  barrier = make_fn([tf.zeros([1])], tf.distribute.experimental.CommunicationOptions(
      implementation=impl))
  rows = []
  for size_mb in settings["sizes_mb"]:
    nbytes = int(size_mb * _MB)
    tensors = [tf.ones([k], tf.float32) for k in _grad_sizes(nbytes)]
    fns = {}
    for pack_mb in settings["packs_mb"]:
      options = tf.distribute.experimental.CommunicationOptions(
          bytes_per_pack=int(pack_mb * _MB), implementation=impl)
      fns[pack_mb] = make_fn(tensors, options)
      fns[pack_mb]()  # trace + warm up
    times = {p: [] for p in fns}
    packs = list(fns)
    for rep in range(settings["reps"]):
      for pack_mb in packs[rep % len(packs):] + packs[:rep % len(packs)]:
        barrier()
        t = time.perf_counter()
        fns[pack_mb]()
        times[pack_mb].append(time.perf_counter() - t)
    for pack_mb, ts in times.items():
      med = bench_common.median(ts)
      alg = nbytes / med
      rows.append({"size_MB": size_mb, "bytes_per_pack_MB": pack_mb,
                   "median_s": med, "times_s": ts, "algbw_MBps": alg / _MB,
                   "busbw_MBps": alg * 2 * (n - 1) / n / _MB})
    logging.info("all-reduce %s MB done", size_mb)
    del tensors, fns
  if me.is_chief:
    with open(FLAGS.result, "w") as f:
      json.dump({"workers": n, "rows": rows}, f)


def _tcp_bandwidth(nbytes, both_directions=False, chunk=4 * _MB):
  """Loopback TCP MB/s per direction: Python sockets, sendall/recv_into."""
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(2)
  port = srv.getsockname()[1]
  pairs = []
  for _ in range(2 if both_directions else 1):
    c = socket.create_connection(("127.0.0.1", port))
    s, _ = srv.accept()
    pairs.append((c, s))
  block = bytes(chunk)

  def send(sock):
    left = nbytes
    while left > 0:
      sock.sendall(block[:min(left, chunk)])
      left -= chunk

  def recv(sock):
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
      k = sock.recv_into(view)
      if not k:
        break
      got += k

  threads = []
  for i, (c, s) in enumerate(pairs):
    src, dst = (c, s) if i == 0 else (s, c)  # the second pair flows back
    threads += [threading.Thread(target=send, args=(src,)),
                threading.Thread(target=recv, args=(dst,))]
  t = time.perf_counter()
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  dt = time.perf_counter() - t
  for c, s in pairs:
    c.close()
    s.close()
  srv.close()
  return nbytes / dt / _MB


# -- scaling --


def _scaling_worker(settings):
  """One worker of a 1- or 2-worker job: tfdp.fit on one CPU core; writes window rates.

  Each worker is pinned to its own core (worker i -> core i mod cores): with
  only one intra-op thread, TF's inter-op threads still kept ~1.4 cores busy
  for ResNet-20, so one worker alone used most of the machine and two could
  not scale.
  """
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(task.get("index", 0)) % (os.cpu_count() or 1)})
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  import tfdp  # pylint: disable=g-import-not-at-top
  strategy = tfdp.make_strategy("multi_worker")
  me = tfdp.cluster.resolve(strategy)
  n = me.count
  g = FLAGS.scaling_batch * n
  window = settings["window_steps"]
  steps = settings["warmup_steps"] + settings["windows"] * window + 1
  x, y = _arrays(settings["num_examples"])
  source = tfdp.data.ArraySource((x, y), name="bench")
  with strategy.scope():
    model = _build_model(seed=0)
    _compile(model)
  stamps = bench_common.step_stamps_callback()

  def make_dataset(first_step):
    return tfdp.data.distribute(strategy, source, global_batch_size=g, seed=0,
                                start_step=first_step)

  tfdp.fit(model, make_dataset, start_step=0, train_steps=steps,
           steps_per_epoch=steps, callbacks=[stamps], verbose=0)
  rates = bench_common.window_rates(stamps.stamps, g, settings["warmup_steps"], window)
  if me.is_chief:
    with open(FLAGS.result, "w") as f:
      json.dump({"workers": n, "global_batch_size": g, "window_rates": rates,
                 "grad_bytes": sum(int(v.numpy().nbytes)
                                   for v in model.trainable_weights),
                 "bytes_per_pack": _default_bytes_per_pack()}, f)


# -- orchestration --


def _internal_args():
  keep = ["model", "image_size", "num_classes", "global_batch_size", "strategy",
          "cpu_replicas", "mixed_precision", "variants", "scaling_batch",
          "warmup_steps", "window_steps", "windows", "rounds", "sizes_mb",
          "packs_mb", "reps", "ckpt_every", "num_examples"]
  args = ["--smoke" if FLAGS.smoke else "--nosmoke",
          "--quick" if FLAGS.quick else "--noquick"]
  for k in keep:
    if FLAGS[k].present:
      v = FLAGS[k].value
      if isinstance(v, list):
        v = ",".join(str(x) for x in v)
      elif isinstance(v, bool):
        args.append(f"--{'' if v else 'no'}{k}")
        continue
      args.append(f"--{k}={v}")
  return args


def _run_job(base, role, num_workers=None, timeout=1800, extra_args=(), env=None):
  """Runs this script as `role` (through tfdp-launch when num_workers); returns worker 0's JSON."""
  from tfdp import launch  # pylint: disable=g-import-not-at-top
  result = os.path.join(base, f"{role}-{num_workers or 0}-{time.monotonic_ns()}.json")
  cmd = [sys.executable, os.path.abspath(__file__), f"--role={role}",
         f"--result={result}"] + _internal_args() + list(extra_args)
  env = bench_common.worker_env(env)
  log_path = result[:-5] + ".log"
  with open(log_path, "w") as log:
    if num_workers is None:
      code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             timeout=timeout)
    else:
      code = launch.launch(cmd, num_workers, env=env, out=log)
  if code != 0 or not os.path.exists(result):
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"benchmark {role} failed (exit {code}); log tail:\n{tail}")
  with open(result) as f:
    return json.load(f)


def _throughput(base, settings):
  res = _run_job(base, "throughput")
  v = res["variants"]
  rows = []
  for name, r in v.items():
    row = {"variant": name, "examples_per_s": r["median_examples_per_s"],
           "windows": len(r["window_rates"])}
    if "plain" in v:
      row["vs_plain"] = r["median_examples_per_s"] / v["plain"]["median_examples_per_s"]
    if name == "tfdp_ckpt" and "tfdp" in v:
      row["vs_tfdp"] = r["median_examples_per_s"] / v["tfdp"]["median_examples_per_s"]
    if name == "plain_ckpt" and "plain" in v:
      row["vs_tfdp"] = None
    rows.append(row)
  # Paired ratios: each variant against plain in the same round (adjacent in
  # time), so slow drifts of the machine's load cancel; median over rounds.
  if "plain" in v:
    base_rounds = [bench_common.median(r) for r in v["plain"]["window_rates_by_round"]]
    for row in rows:
      mine = [bench_common.median(r) for r in v[row["variant"]]["window_rates_by_round"]]
      row["paired_vs_plain"] = bench_common.median(
          [a / b for a, b in zip(mine, base_rounds) if b])
  targets = {}
  if "plain" in v and "tfdp" in v:
    ratio = v["tfdp"]["median_examples_per_s"] / v["plain"]["median_examples_per_s"]
    paired = next(r["paired_vs_plain"] for r in rows if r["variant"] == "tfdp")
    targets["tfdp_vs_plain"] = {"ratio": ratio, "paired_ratio": paired, "target": 0.97,
                                "met": ratio >= 0.97, "paired_met": paired >= 0.97}
  if "plain" in v and "tfdp_ckpt" in v:
    ratio = v["tfdp_ckpt"]["median_examples_per_s"] / v["plain"]["median_examples_per_s"]
    paired = next(r["paired_vs_plain"] for r in rows if r["variant"] == "tfdp_ckpt")
    targets["tfdp_ckpt_vs_plain"] = {"ratio": ratio, "paired_ratio": paired, "target": 0.95,
                                     "met": ratio >= 0.95, "paired_met": paired >= 0.95}
  return {"rows": rows, "targets": targets, "raw": res,
          "settings": {"model": FLAGS.model, "global_batch_size": FLAGS.global_batch_size,
                       "strategy": FLAGS.strategy, "cpu_replicas": FLAGS.cpu_replicas,
                       "ckpt_every": settings["ckpt_every"],
                       "window_steps": settings["window_steps"],
                       "windows_per_call": settings["windows"],
                       "rounds": settings["rounds"]}}


def _allreduce(base, settings):
  tcp_mb = settings["tcp_mb"]
  tcp = {"one_way": [], "both_ways": []}

  def measure_tcp():
    for _ in range(3):
      tcp["one_way"].append(_tcp_bandwidth(tcp_mb * _MB))
      tcp["both_ways"].append(_tcp_bandwidth(tcp_mb * _MB, both_directions=True))

  measure_tcp()
  res = _run_job(base, "allreduce", num_workers=2)
  measure_tcp()
  tcp_one = bench_common.median(tcp["one_way"])
  tcp_both = bench_common.median(tcp["both_ways"])
  rows = res["rows"]
  best = {}
  for r in rows:
    r["busbw_vs_tcp_both"] = r["busbw_MBps"] / tcp_both
    if r["size_MB"] not in best or r["busbw_MBps"] > best[r["size_MB"]]["busbw_MBps"]:
      best[r["size_MB"]] = r
  # Pick the pack size whose geometric-mean speedup over the default is best
  # for gradients of 16 MB or more (ResNet-50 is ~100 MB, BERT-base ~440 MB).
  packs = sorted({r["bytes_per_pack_MB"] for r in rows})
  big = [s for s in sorted(best) if s >= 16] or sorted(best)
  score = {}
  for p in packs:
    ratios = []
    for s in big:
      by = {r["bytes_per_pack_MB"]: r for r in rows if r["size_MB"] == s}
      if p in by and 0 in by:
        ratios.append(by[0]["median_s"] / by[p]["median_s"])
    if ratios:
      prod = 1.0
      for x in ratios:
        prod *= x
      score[p] = prod ** (1 / len(ratios))
  recommended = max(score, key=score.get) if score else 0
  return {"rows": rows, "tcp_MBps": {"one_way": tcp_one, "both_ways_per_direction": tcp_both,
                                     "samples": tcp, "bytes": tcp_mb * _MB},
          "speedup_vs_default_geomean": {str(k): v for k, v in score.items()},
          "recommended_bytes_per_pack_MB": recommended,
          "recommended_speedup": score.get(recommended)}


def _allreduce_seconds(allreduce, nbytes, pack_mb):
  """All-reduce time of nbytes at bytes_per_pack pack_mb, log-log interpolated from the table."""
  pts = sorted((r["size_MB"] * _MB, r["median_s"]) for r in allreduce["rows"]
               if r["bytes_per_pack_MB"] == pack_mb)
  if not pts:
    return None
  if nbytes <= pts[0][0]:
    return pts[0][1] * nbytes / pts[0][0]
  for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
    if nbytes <= x1:
      f = math.log(nbytes / x0) / math.log(x1 / x0)
      return math.exp(math.log(y0) + f * math.log(y1 / y0))
  return pts[-1][1] * nbytes / pts[-1][0]


_CORE_PROBE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
x = tf.random.normal([8, 32, 32, 64])
k = tf.random.normal([3, 3, 64, 64])
f = tf.function(lambda: tf.nn.conv2d(x, k, 1, "SAME"))
f()
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
  f()
print(time.perf_counter() - t)
"""


def _core_ceiling(iterations):
  """What 2 cores give over 1 for the same compute-bound TF kernel (conv2d).

  Two processes pinned to cores 0 and 1 against one alone: a VM's vCPUs can
  share a physical core's vector units, and then no training job scales by 2
  on them either.
  """
  def run(cores):
    procs = [subprocess.Popen([sys.executable, "-c", _CORE_PROBE, str(c), str(iterations)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=bench_common.worker_env())
             for c in cores]
    return [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
  if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
    return None
  if FLAGS.smoke:
    # The pair alone runs every line of run() (a TF process less); at the
    # smoke run's 2 iterations the figure means nothing anyway.
    both = run([0, 1])
    alone = both[0]
  else:
    alone = run([0])[0]
    both = run([0, 1])
  return (iterations / both[0] + iterations / both[1]) / (2 * iterations / alone)


def _default_bytes_per_pack():
  """make_strategy's bytes_per_pack when given none, for ring collectives between CPU workers."""
  from tfdp.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  pack = inspect.signature(strategy_lib.make_strategy).parameters["bytes_per_pack"].default
  if pack is None:
    pack = strategy_lib.default_bytes_per_pack("ring", have_gpus=False)
  return pack


def _scaling(base, settings, allreduce=None):
  models = FLAGS.scaling_models[:1] if FLAGS.smoke else FLAGS.scaling_models
  # The workers report make_strategy's default bytes_per_pack (they import
  # tfdp anyway; this process stays without TensorFlow).
  rows, samples, pack = [], {}, None
  for model in models:
    rates, grad_bytes = {1: [], 2: []}, None
    for r in range(settings["scaling_rounds"]):
      for n in ((1, 2) if r % 2 == 0 else (2, 1)):
        res = _run_job(base, "scaling", num_workers=n, extra_args=[f"--model={model}"])
        rates[n].extend(res["window_rates"])
        grad_bytes, pack = res["grad_bytes"], res["bytes_per_pack"]
    r1, r2 = bench_common.median(rates[1]), bench_common.median(rates[2])
    # The alpha-beta check: one worker's step time plus the measured 2-worker
    # all-reduce of this model's gradients (at the default bytes_per_pack).
    t1 = FLAGS.scaling_batch / r1
    t_ar = (_allreduce_seconds(allreduce, grad_bytes, pack / _MB)
            if allreduce else None)
    predicted = t1 / (t1 + t_ar) if t_ar else None
    rows += [{"model": model, "grad_MB": grad_bytes / _MB, "workers": 1,
              "examples_per_s": r1, "speedup": 1.0, "efficiency": 1.0},
             {"model": model, "grad_MB": grad_bytes / _MB, "workers": 2,
              "examples_per_s": r2, "speedup": r2 / r1, "efficiency": r2 / (2 * r1),
              "predicted_efficiency": predicted, "allreduce_s": t_ar,
              "step_s_1_worker": t1}]
    samples[model] = {str(k): v for k, v in rates.items()}
  ceiling = _core_ceiling(2 if FLAGS.smoke else 300)
  return {"rows": rows, "per_worker_batch": FLAGS.scaling_batch, "intra_op_threads": 1,
          "cores_per_worker": 1, "core_ceiling_efficiency": ceiling,
          "bytes_per_pack": pack, "window_rates": samples}


def _print(out):
  if "throughput" in out:
    t = out["throughput"]
    print(f"\nThroughput ({t['settings']}), examples/s: median of timed windows")
    print(bench_common.table(t["rows"], [
        ("variant", "variant", None), ("examples_per_s", "examples/s", "{:.1f}"),
        ("vs_plain", "vs plain", "{:.3f}"),
        ("paired_vs_plain", "vs plain, paired by round", "{:.3f}"),
        ("vs_tfdp", "vs tfdp", "{:.3f}"),
        ("windows", "windows", "{}")]))
    for k, v in t["targets"].items():
      print(f"  target {k}: {v['ratio']:.3f} (paired {v['paired_ratio']:.3f}) >= "
            f"{v['target']}: {'MET' if v['met'] else 'MISSED'}"
            f"{'' if v['paired_met'] == v['met'] else ' (paired: the other way)'}")
  if "allreduce" in out:
    a = out["allreduce"]
    tcp = a["tcp_MBps"]
    print(f"\nRING all-reduce, 2 workers on localhost; raw loopback TCP: "
          f"{tcp['one_way']:.0f} MB/s one way, {tcp['both_ways_per_direction']:.0f} "
          "MB/s per direction both ways")
    print(bench_common.table(a["rows"], [
        ("size_MB", "gradients MB", "{:g}"), ("bytes_per_pack_MB", "bytes_per_pack MB", "{:g}"),
        ("median_s", "time s", "{:.4f}"), ("busbw_MBps", "bus MB/s", "{:.0f}"),
        ("busbw_vs_tcp_both", "bus/TCP", "{:.2f}")]))
    print(f"  speedup vs bytes_per_pack=0 (geomean over >=16 MB): "
          f"{a['speedup_vs_default_geomean']}; best: {a['recommended_bytes_per_pack_MB']} MB")
  if "scaling" in out:
    s = out["scaling"]
    print(f"\nScaling on localhost, {s['per_worker_batch']} examples per worker per step, "
          "each worker pinned to its own core, 1 intra-op thread")
    print(bench_common.table(s["rows"], [
        ("model", "model", None), ("grad_MB", "grad MB", "{:.1f}"),
        ("workers", "workers", "{}"), ("examples_per_s", "examples/s", "{:.1f}"),
        ("speedup", "speedup", "{:.2f}"), ("efficiency", "efficiency", "{:.2f}"),
        ("predicted_efficiency", "alpha-beta predicted", "{:.2f}")]))
    if s.get("core_ceiling_efficiency") is not None:
      print(f"  ceiling of this machine: 2 processes of a compute-bound TF conv2d "
            f"on cores 0 and 1 reach {s['core_ceiling_efficiency']:.2f} of 2x one alone")
  if "overlap" in out:
    o = out["overlap"]
    print(f"\nOverlap: 2 workers on localhost, {FLAGS.scaling_batch} examples per worker per "
          "step, each pinned to its own core; speedup over the user's own MWMS (upstream)")
    print(bench_common.table(o["rows"], [
        ("model", "model", None), ("grad_MB", "grad MB", "{:.1f}"), ("variant", "variant", None),
        ("step_ms", "step ms", "{:.1f}"), ("speedup", "speedup", "{:.2f}"),
        ("efficiency", "efficiency", "{:.2f}"), ("t_comp_ms", "T_comp ms", "{:.1f}"),
        ("t_comm_ms", "T_comm ms", "{:.1f}"), ("hidden", "hidden", "{:.2f}")]))
    if o.get("core_ceiling_efficiency") is not None:
      print(f"  ceiling of this machine: {o['core_ceiling_efficiency']:.2f} (2 pinned processes "
            "of a compute-bound TF conv2d against one alone)")
  print(f"\nload average: start {out['machine']['load_avg_start']}, end {out['load_avg_end']}")


def main(argv):
  del argv
  if FLAGS.smoke and FLAGS.model == "mlp" and not FLAGS["image_size"].present:
    # 8x8 images: the mlp has 1.2M parameters instead of 4.2M; every part runs
    # the same code at any size, and the smoke run only checks that it runs.
    FLAGS.image_size = 8
  settings = _settings()
  if FLAGS.role:
    logging.set_verbosity(logging.WARNING)
    if FLAGS.role == "overlap":
      bench_overlap.worker(settings, FLAGS, _build_model, _compile, _arrays, bench_common)
      return
    {"throughput": _throughput_worker, "allreduce": _allreduce_worker,
     "scaling": _scaling_worker}[FLAGS.role](settings)
    return
  bench_common.wait_for_quiet(FLAGS.max_load, FLAGS.wait_quiet_s, log=logging.info)
  out = {"machine": bench_common.machine(), "quick": FLAGS.quick, "smoke": FLAGS.smoke,
         "command": " ".join(sys.argv), "load": {}}
  base = tempfile.mkdtemp(prefix="tfdp_bench_train_")
  parts = {"throughput": _throughput, "allreduce": _allreduce, "scaling": _scaling,
           "overlap": lambda base, settings: bench_overlap.run(
               base, settings, _run_job,
               FLAGS.overlap_models[:1] if FLAGS.smoke else FLAGS.overlap_models,
               bench_common.median, lambda: _core_ceiling(2 if FLAGS.smoke else 300),
               mirrored_only=FLAGS.overlap_mirrored_only)}
  try:
    for part in FLAGS.parts:
      if part not in parts:
        raise app.UsageError(f"unknown part {part!r}; choose from {sorted(parts)}")
      load = bench_common.wait_for_quiet(FLAGS.max_load, FLAGS.wait_quiet_s,
                                         log=logging.info)
      logging.info("part %s (load %s)", part, load)
      t = time.perf_counter()
      if part == "scaling":
        out[part] = _scaling(base, settings, out.get("allreduce"))
      else:
        out[part] = parts[part](base, settings)
      out["load"][part] = {"before": load, "after": bench_common.load_average(),
                           "seconds": time.perf_counter() - t}
  finally:
    shutil.rmtree(base, ignore_errors=True)
  out["load_avg_end"] = bench_common.load_average()
  _print(out)
  bench_common.write_json(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
