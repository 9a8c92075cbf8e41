"""The `overlap` part of bench_train.py: the gradient path's buckets and compression on 2 localhost workers.

Each worker is pinned to its own core with one intra-op thread (as the
scaling part), and trains plain `model.fit` on a `tf.data` pipeline, 32
examples per worker per step. Jobs, each one `tfdp-launch` of 2 workers:

- `own`: the user's own `tf.distribute.MultiWorkerMirroredStrategy()` with
  `import tfdp`. Its variants are interleaved in rotated rounds inside the
  job, one model each (the same seed): `one_pack` (tfdp's gradient path with
  `bucket_cap_mb=0`: one all-reduce of every gradient after backward, as
  upstream), `buckets` (the default: 25 MB buckets, 1 MB first),
  `buckets_bf16`, `buckets_fp16`. Beside them, in the same rounds,
  T_comm: the all-reduce alone of the model's gradient shapes in one pack,
  as float32, bfloat16 and float16.
- `upstream`: the same script with TFDP_COMPAT_DISABLE=gradient_path (Keras's
  own all-reduce): the user's own MWMS today.
- `tfdp_today`: `tfdp.make_strategy()` with TFDP_COMPAT_DISABLE=gradient_path.
- `alone`: one worker, the same per-worker batch: T_comp (no communication).
- the machine's ceiling: what two processes of a compute-bound TF conv2d,
  pinned to the two cores, reach against one alone (bench_train.py's
  scaling part measures it the same way).

- `mirrored`, `mirrored_upstream`: one process, the user's own
  MirroredStrategy over 2 logical CPUs (not pinned), the gradient path's
  defaults against TFDP_COMPAT_DISABLE=gradient_path, alternated.

Per variant: the step time (median of timed windows), the speedup over
`upstream`, the efficiency against `alone` (rate of 2 / 2x rate of 1), and
the hidden fraction (T_one_pack - T_variant) / T_comm of the variant's dtype.
"""

import json
import os
import time

_MB = 1 << 20
VARIANTS = {"one_pack": dict(bucket_cap_mb=0, compression=None),
            "buckets": dict(compression=None),
            "buckets_bf16": dict(compression="bf16"),
            "buckets_fp16": dict(compression="fp16")}
COMM = ("float32", "bfloat16", "float16")
JOBS = {"own": ("own", 2, None), "upstream": ("own", 2, "gradient_path"),
        "tfdp_today": ("tfdp", 2, "gradient_path"), "alone": ("own", 1, None)}
# The user's own MirroredStrategy over 2 logical CPUs in one process: the
# gradient path's defaults against stock Keras (separate processes, alternated).
MIRRORED_JOBS = {"mirrored": None, "mirrored_upstream": "gradient_path"}


def worker(settings, flags, build_model, compile_model, arrays, common):
  """One worker of an overlap job; worker 0 writes the results to flags.result."""
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  if flags.overlap_strategy == "mirrored":
    return _mirrored_worker(settings, flags, build_model, compile_model, arrays, common)
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(task.get("index", 0)) % (os.cpu_count() or 1)})
  import tfdp  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  if flags.overlap_strategy == "tfdp":
    strategy = tfdp.make_strategy("multi_worker")
  else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
  me = tfdp.cluster.resolve(strategy)
  g = flags.scaling_batch * me.count
  window, warmup = settings["window_steps"], settings["warmup_steps"]
  x, y = arrays(settings["num_examples"])
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(g).prefetch(2)
  variants = (["one_pack"] if flags.overlap_variants == "one" or me.count == 1
              else list(VARIANTS))
  models = {}
  for name in variants:
    tfdp.configure_gradients(**{**dict(bucket_cap_mb=25.0), **VARIANTS[name]})
    with strategy.scope():
      models[name] = build_model(seed=0)
      compile_model(models[name])
    models[name].fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)  # trace with its settings
  grads = [tf.zeros_like(v) for v in models[variants[0]].trainable_variables]
  grad_bytes = sum(int(v.numpy().nbytes) for v in models[variants[0]].trainable_variables)
  comm = {}
  if me.count > 1:
    for dtype in COMM:
      comm[dtype] = _all_reduce_fn(strategy, [tf.cast(t, dtype) for t in grads])
      comm[dtype]()
  rates = {name: [] for name in variants}
  comm_s = {dtype: [] for dtype in comm}
  for r in range(settings["rounds"]):
    order = variants[r % len(variants):] + variants[:r % len(variants)]
    for name in order:
      stamps = common.step_stamps_callback()
      models[name].fit(dataset, steps_per_epoch=warmup + settings["windows"] * window + 1,
                       epochs=1, verbose=0, callbacks=[stamps])
      rates[name] += common.window_rates(stamps.stamps, g, warmup, window)
    for dtype, fn in comm.items():
      for _ in range(settings["reps"]):
        t = time.perf_counter()
        fn()
        comm_s[dtype].append(time.perf_counter() - t)
  if me.is_chief:
    with open(flags.result, "w") as f:
      json.dump({"workers": me.count, "global_batch_size": g, "grad_bytes": grad_bytes,
                 "rates": rates, "comm_s": comm_s}, f)


def _mirrored_worker(settings, flags, build_model, compile_model, arrays, common):
  """One process: the user's own MirroredStrategy over 2 logical CPUs, the gradient path's defaults."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top,unused-import
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  g = flags.scaling_batch * 2
  x, y = arrays(settings["num_examples"])
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(g).prefetch(2)
  with strategy.scope():
    model = build_model(seed=0)
    compile_model(model)
  window, warmup = settings["window_steps"], settings["warmup_steps"]
  stamps = common.step_stamps_callback()
  model.fit(dataset, steps_per_epoch=warmup + settings["windows"] * window + 1, epochs=1,
            verbose=0, callbacks=[stamps])
  with open(flags.result, "w") as f:
    json.dump({"global_batch_size": g,
               "rates": common.window_rates(stamps.stamps, g, warmup, window)}, f)


def _worker_rows(model, results, median):
  """The rows of the 2-worker jobs of `model`: step time, speedup, efficiency, hidden fraction."""
  rows = []
  g = results["own"]["global_batch_size"]
  step = {job: g / median(results[job]["rates"]["one_pack"]) for job in ("upstream", "tfdp_today")}
  step.update({v: g / median(r) for v, r in results["own"]["rates"].items()})
  t_alone = results["alone"]["global_batch_size"] / median(results["alone"]["rates"]["one_pack"])
  comm = {d: median(ts) for d, ts in results["own"]["comm_s"].items()}
  wire = {"upstream": "float32", "tfdp_today": "float32", "one_pack": "float32",
          "buckets": "float32", "buckets_bf16": "bfloat16", "buckets_fp16": "float16"}
  for variant, dtype in wire.items():
    t = step[variant]
    rows.append({"model": model, "grad_MB": results["own"]["grad_bytes"] / _MB,
                 "variant": variant, "step_ms": 1e3 * t, "speedup": step["upstream"] / t,
                 "efficiency": t_alone / t, "t_comp_ms": 1e3 * t_alone,
                 "t_comm_ms": 1e3 * comm[dtype], "hidden": (step["one_pack"] - t) / comm[dtype]})
  return rows


def _all_reduce_fn(strategy, tensors):
  """A tf.function: one all-reduce of `tensors` in one pack (the all-reduce alone)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  options = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=sum(int(t.shape.num_elements()) * t.dtype.size for t in tensors) + 1)

  @tf.function
  def fn():
    def replica_fn():
      out = tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tensors, options=options)
      return out[0][:1]
    return strategy.run(replica_fn)

  def call():
    return strategy.experimental_local_results(fn())[0].numpy()  # waits for the result

  return call


def run(base, settings, run_job, models, median, ceiling, mirrored_only=False):
  """The overlap part: every job of every model, and the machine's ceiling (`ceiling()`); returns its rows.

  With `mirrored_only`, only the MirroredStrategy jobs.
  """
  rows, raw = [], {}
  for model in models:
    results = {}
    for job, (strategy, workers, disable) in ({} if mirrored_only else JOBS).items():
      extra = [f"--model={model}", f"--overlap_strategy={strategy}",
               f"--overlap_variants={'all' if job == 'own' else 'one'}"]
      results[job] = run_job(base, "overlap", num_workers=workers, extra_args=extra,
                             env={"TFDP_COMPAT_DISABLE": disable} if disable else None)
    raw[model] = results
    if not mirrored_only:
      rows += _worker_rows(model, results, median)
    rates = {job: [] for job in MIRRORED_JOBS}
    for r in range(settings["rounds"]):
      for job in (list(MIRRORED_JOBS) if r % 2 == 0 else list(MIRRORED_JOBS)[::-1]):
        disable = MIRRORED_JOBS[job]
        res = run_job(base, "overlap", extra_args=[f"--model={model}", "--overlap_strategy=mirrored"],
                      env={"TFDP_COMPAT_DISABLE": disable} if disable else None)
        rates[job] += res["rates"]
        g = res["global_batch_size"]
    raw[model]["mirrored"] = rates
    up = g / median(rates["mirrored_upstream"])
    for job in MIRRORED_JOBS:
      t = g / median(rates[job])
      rows.append({"model": model, "variant": job, "step_ms": 1e3 * t, "speedup": up / t})
  return {"rows": rows, "core_ceiling_efficiency": ceiling(), "raw": raw}
