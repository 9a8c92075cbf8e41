"""Local checkpoint tier benchmark: fit throughput, restore per tier, peer recovery, chaos goodput.

Parts (--parts, all by default), each measured side by side in one run:

  throughput  plain `model.fit` steps/s with no checkpoints, with the callback
              never saving (backup_nosave: the baseline), with local saves
              every N steps for each N of --local_every (1, 5 and "auto" with
              a 2% budget: BackupAndRestore(save_freq=False,
              local_checkpoint_every_steps=N)), with async and sync persistent
              saves every --persistent_every steps; for each setup of
              --fit_cores: "busy" (TF's defaults: training fills both cores)
              and "free" (training confined to one thread, as on a GPU host
              whose cores are mostly idle); one fresh process per run, rounds
              interleaved, median of windows after warm-up.
  restore     one process, 256 MB and 1 GB of state: process start to the first
              step and the restore call alone, from the local tier (/dev/shm)
              and from the persistent tier (the VM disk), the latter with the
              page cache dropped first (cold) and not (warm). Each local
              restore call is split into its phases (the local
              tier's PhaseTimes), each beside its floor measured in the same
              process over the same slot (map, CRC32C, memcpy, read).
  peer        2 workers (tfdp-launch, MultiWorkerMirroredStrategy): restore with
              both local copies, with worker 1's deleted (peer recovery: worker 0
              sends the copy's files over the side channel) and from the
              persistent tier; beside a raw TCP transfer of the same bytes from
              worker 0 to worker 1 in the same run (the floor); the slowest
              worker's restore call split into its phases, as above. The
              figure: the transfer, the receiver's wait from the agreement
              that lets the holder send to the copy checked in its slot
              (`wait`), over the raw transfer. --peer_tiers=peer restores
              from the peer only; --peer_probe prints both workers' timeline
              of the transfer, the holder's sendfile pieces and each thread's
              CPU and runnable-but-waiting seconds (scripts/peer_probe.py).
  chaos       the fault-tolerance tests' 2-worker job with 5 seeded SIGKILLs at
              steps, with local saves every step, every "auto" steps and without:
              goodput and the steps recomputed per failure.
"""

import json
import os
import random
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
# The last two tell apart where the local saves' cost goes: the data
# position's checkpointable iterator alone (a backup that never saves), and
# local saves without the data position (TFDP_COMPAT_DISABLE=fit_data_state).
_NOSAVE = "backup_nosave"
_FIT_VARIANTS = ("none", "local", "persistent_async", "persistent_sync", "backup_nosave",
                 "local_no_position")
flags.DEFINE_list("parts", ["throughput", "restore", "peer", "chaos"], "Parts to run.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, one round, no chaos (tests: only checks it runs).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_string("dir", None, "Scratch directory on the disk (the persistent tier; "
                    "default: a temp dir).")
flags.DEFINE_string("local_root", "/dev/shm", "Where the local tier goes (RAM-backed).")
flags.DEFINE_integer("rounds", 4, "Interleaved rounds of each throughput variant.")
flags.DEFINE_integer("fit_steps", 400, "Steps of each throughput run.")
flags.DEFINE_list("fit_variants", list(_FIT_VARIANTS), "Throughput variants to run "
                  "(none and local needed).")
flags.DEFINE_list("local_every", ["1", "5", "auto"], "Intervals of the local variants "
                  "(local and local_no_position run once per interval).")
flags.DEFINE_list("fit_cores", ["busy", "free"], "Throughput setups: busy (TF's default "
                  "threads, training fills the cores) and free (intra- and inter-op threads 1: "
                  "a core left free, as on a GPU host).")
flags.DEFINE_float("overhead", 0.02, "checkpoint_overhead of the 'auto' local variant.")
flags.DEFINE_integer("persistent_every", 50, "Steps between the persistent variants' saves.")
flags.DEFINE_enum("fit_setup", "conv", ["conv", "mirrored"], "Throughput part's script: a small "
                  "conv net with no strategy and ~4 MB of state (conv), or the user's own "
                  "MirroredStrategy over 2 logical CPUs, an MLP with 16 MB of state and "
                  "shuffle(2048) of decoded uint8 images, a data position of ~6 MB (mirrored).")
flags.DEFINE_list("restore_mb", ["256", "1024"], "State sizes of the restore part.")
flags.DEFINE_integer("restore_reps", 2, "Restores per tier and size.")
flags.DEFINE_list("peer_mb", ["256", "1024"], "State sizes of the peer part.")
flags.DEFINE_integer("peer_reps", 2, "Restores per tier of the peer part (1 for sizes > 256 MB).")
flags.DEFINE_list("peer_tiers", ["local", "peer", "persistent"],
                  "Tiers the peer part restores from, in order (peer alone: the transfer only).")
flags.DEFINE_bool("peer_probe", False, "Peer part: each worker's timeline, sendfile pieces and "
                  "per-thread CPU of the transfer (scripts/peer_probe.py), printed.")
flags.DEFINE_integer("chaos_seed", 6, "Seed of the chaos plan.")
flags.DEFINE_bool("drop_caches", True, "Drop the page cache before cold restores (needs root).")
# Internal: set when this script runs as one benchmark child.
flags.DEFINE_string("role", None, "internal: fit | make | restore")
flags.DEFINE_string("variant", None, "internal: the variant measured")
flags.DEFINE_string("every", "5", "internal: the local variant's interval")
flags.DEFINE_string("cores", "busy", "internal: the throughput run's setup (busy | free)")
flags.DEFINE_integer("mb", 16, "internal: state size in MB")
flags.DEFINE_string("work", None, "internal: work directory (the persistent tier under it)")
flags.DEFINE_string("local_dir", None, "internal: the local tier's directory")
flags.DEFINE_string("result", None, "internal: where a child writes its result")

_MB = 1 << 20
_VAR_MB = 16  # State is made of float32 variables of this size.
_BATCH = 32
_SAVE_EVERY = 5
_PERSISTENT_STEP = 100  # The restore parts' persistent checkpoint; the local one is a step newer.


def _log(msg):
  print(f"[bench_tiers] {msg}", flush=True)


# --- Children -------------------------------------------------------------


def _fit_child():
  """One throughput run of plain model.fit with FLAGS.variant's checkpoints."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  if FLAGS.cores == "free":  # Training in one thread; the other core is free for the writer.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
  if FLAGS.fit_setup == "mirrored":
    # As a user sets it up: two logical CPUs, their own MirroredStrategy.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    images = rng.integers(0, 256, size=(4096, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=4096)
    ds = (tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(2048, seed=1)
          .map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).batch(64).prefetch(2))
    keras.utils.set_random_seed(0)
    with strategy.scope():  # 1.38M parameters: 16 MB with Adam's two slots
      model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                                keras.layers.Dense(448, activation="relu"), keras.layers.Dense(10)])
      model.compile(optimizer="adam",
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  else:
    keras.utils.set_random_seed(0)
    # A small conv net: steps of tens of ms on 2 cores and ~4 MB of state with
    # Adam's slots, so a save copies a few MB, as a small real model does.
    model = keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(1024, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=1024)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(_BATCH).prefetch(2)
  # Whole iterator states taken (tf.data's SerializeIterator: what a data
  # position costs most), counted in this run.
  from tensorflow.python.ops import gen_dataset_ops  # pylint: disable=g-import-not-at-top
  whole = []
  real_capture = gen_dataset_ops.serialize_iterator
  gen_dataset_ops.serialize_iterator = lambda *a, **k: whole.append(1) or real_capture(*a, **k)
  stamps = bench_common.step_stamps_callback()
  callbacks = [stamps]
  backup = None
  backup_dir = os.path.join(FLAGS.work, "backup")
  local_dir = os.path.join(FLAGS.local_root, f"tfdp_bench_tiers_{os.getpid()}")
  if FLAGS.variant in ("local", "local_no_position"):
    backup = tfdp.callbacks.BackupAndRestore(
        backup_dir, save_freq=False, local_checkpoint_dir=local_dir,
        local_checkpoint_every_steps=FLAGS.every if FLAGS.every == "auto" else int(FLAGS.every),
        checkpoint_overhead=FLAGS.overhead)
  elif FLAGS.variant in ("persistent_async", "persistent_sync"):
    backup = tfdp.callbacks.BackupAndRestore(
        backup_dir, save_freq=FLAGS.persistent_every,
        async_save=FLAGS.variant == "persistent_async")
  elif FLAGS.variant == "backup_nosave":
    backup = tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=False)
  skipped = []
  if backup is not None:

    class Skipped(keras.callbacks.Callback):
      """Reads the manager's count before BackupAndRestore's on_train_end lets it go."""

      def on_train_end(self, logs=None):
        skipped.append(getattr(backup.manager, "local_saves_skipped", None))
        skipped.append(getattr(backup.manager, "local_interval", None))

    callbacks[:0] = [Skipped(), backup]
  try:
    model.fit(ds, epochs=1, steps_per_epoch=FLAGS.fit_steps, callbacks=callbacks, verbose=0)
  finally:
    shutil.rmtree(local_dir, ignore_errors=True)
    shutil.rmtree(backup_dir, ignore_errors=True)
  warmup = min(50, FLAGS.fit_steps // 4)
  window = max(5, min(50, (FLAGS.fit_steps - warmup) // 4))
  rates = bench_common.window_rates(stamps.stamps, 1, warmup, window)  # steps/s
  state = sum(v.numpy().nbytes for v in model.variables + model.optimizer.variables)
  # Step i + 1 ends at stamps[i], after the callback's save (if due) there:
  # steps that save show the blocking, the others any background contention.
  ms = {True: [], False: []}
  every = (FLAGS.persistent_every if FLAGS.variant.startswith("persistent") else
           int(FLAGS.every) if FLAGS.every.isdigit() else _SAVE_EVERY)
  for i in range(warmup, len(stamps.stamps)):
    ms[(i + 1) % every == 0].append(1000 * (stamps.stamps[i] - stamps.stamps[i - 1]))
  _write({"rates": rates, "state_bytes": state, "whole_states": len(whole),
          "local_saves_skipped": skipped[0] if skipped else None,
          "local_interval": skipped[1] if skipped else None,
          "save_step_ms": bench_common.median(ms[True]),
          "other_step_ms": bench_common.median(ms[False])})


def _state(strategy, mb):
  """FLAGS.mb MB of float32 variables (16 MB each, zeros) and a step counter, under `strategy`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_var = _VAR_MB * _MB // 4
  with strategy.scope():
    variables = [tf.Variable(tf.zeros([per_var]), name=f"v{i}")
                 for i in range(max(1, mb // _VAR_MB))]
    step = tf.Variable(0, dtype=tf.int64, name="step")
  return variables, step


def _manager(variables, step, strategy, work, local):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  module = tf.Module()
  module.vars = variables
  ckpt = tf.train.Checkpoint(m=module, step=step)
  with strategy.scope():
    return tfdp.CheckpointManager(
        ckpt, os.path.join(work, "persistent"), max_to_keep=2, step_counter=step,
        strategy=strategy if strategy.num_replicas_in_sync > 1 else None,
        commit_timeout=600, local_checkpoint_dir=FLAGS.local_dir if local else None)


def _strategy():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if int(os.environ.get("TFDP_NUM_WORKERS", "1")) > 1:
    return tf.distribute.MultiWorkerMirroredStrategy()
  return tf.distribute.get_strategy()


def _make_child():
  """Saves FLAGS.mb MB: persistent at step 100, then the local tier at step 101."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = _strategy()
  variables, step = _state(strategy, FLAGS.mb)
  for i, v in enumerate(variables):
    v.assign(tf.random.uniform(v.shape, seed=i))
  mgr = _manager(variables, step, strategy, FLAGS.work, local=True)
  step.assign(_PERSISTENT_STEP)
  mgr.save(checkpoint_number=_PERSISTENT_STEP, check_interval=False)
  mgr.sync()
  step.assign_add(1)
  variables[0].assign_add(tf.ones_like(variables[0]))
  mgr.save_local(_PERSISTENT_STEP + 1)
  mgr.sync()
  mgr.close()
  _write({"local": mgr.local_checkpoints()}, per_worker=True)


def _restore_child():
  """Restores from the tier FLAGS.variant names, then takes one step; writes wall-clock stamps.

  The single-process child waits on stdin after its imports and set-up, so
  the parent can drop the page cache (of the checkpoint only: TF's libraries
  are mapped then) between set-up and restore.
  """
  stamps = {"start": float(os.environ["BENCH_T0"])}
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = _strategy()
  variables, step = _state(strategy, FLAGS.mb)
  mgr = _manager(variables, step, strategy, FLAGS.work, local=FLAGS.variant != "persistent")

  @tf.function
  def train_step():
    # Reads and updates the state, as a step does; under MWMS the reduce is a
    # collective, so the first step ends once every worker has restored.
    total = strategy.reduce(
        "SUM", strategy.run(lambda: tf.reduce_sum(variables[-1][:8])), axis=None)
    variables[0].assign_add(tf.ones_like(variables[0]))
    step.assign_add(1)
    return total

  stamps["ready"] = time.time()
  if os.environ.get("BENCH_HANDSHAKE"):
    print("ready", flush=True)
    sys.stdin.readline()
  stamps["go"] = time.time()
  phases = mgr._local.phases if mgr._local is not None else None  # pylint: disable=protected-access
  if phases is not None:
    phases.take()
  if FLAGS.peer_probe and FLAGS.variant == "peer":
    import peer_probe  # pylint: disable=g-import-not-at-top
    peer_probe.install()
  prefix = mgr.restore_or_initialize()
  if FLAGS.peer_probe and FLAGS.variant == "peer":
    stamps["probe"] = peer_probe.take()
  stamps["restored"] = time.time()
  stamps["phases"] = phases.take() if phases is not None else {}
  if mgr.restored_tier in ("local", "peer"):
    stamps["floors"] = _floors(prefix)
  train_step()
  stamps["first_step"] = time.time()
  got = int(step.numpy())
  if FLAGS.variant == "peer":
    stamps["raw_transfer_s"], stamps["raw_transfer_cpu_s"] = _raw_transfer(strategy,
                                                                           FLAGS.mb * _MB)
  # TF's restore alone of the same files, now that the process has read them
  # once: the part of the restore call that is reading the state.
  t = time.time()
  mgr.checkpoint.restore(prefix)
  stamps["tf_restore_again_s"] = time.time() - t
  mgr.close()
  want = _PERSISTENT_STEP + (1 if FLAGS.variant == "persistent" else 2)
  if got != want or prefix is None:
    raise RuntimeError(f"{FLAGS.variant}: restored {prefix} (tier {mgr.restored_tier}), "
                       f"step {got} after one step, expected {want}")
  _write(dict(stamps, tier=mgr.restored_tier, prefix=prefix), per_worker=True)


def _floors(prefix):
  """Seconds of each restore phase's floor, in this process, over the slot local copy `prefix` is in.

  map: the slot mapped and faulted in (as the restore maps it); crc32c:
  tfdp's CRC32C (tfdp.checkpoint.format.checksum) over each tensor's bytes;
  memcpy_new: numpy copies of them
  into memory never touched before (as TF's tensors of the restore are);
  memcpy_reused: the same into that memory again; read: the file read
  into that memory (no mapping).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import checksum  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import slot_file  # pylint: disable=g-import-not-at-top
  record = manifest_lib.read_manifest(prefix).slot
  path = os.path.join(os.path.dirname(prefix), record.name)
  out = {}
  t = time.perf_counter()
  mapped = slot_file.open_read(path, record.size)
  out["map"] = time.perf_counter() - t
  view = np.frombuffer(mapped, np.uint8)
  parts = [view[e.offset:e.offset + e.size] for e in record.entries]
  t = time.perf_counter()
  for p in parts:
    checksum.value(p)
  out["crc32c"] = time.perf_counter() - t
  t = time.perf_counter()
  copies = [np.copy(p) for p in parts]
  out["memcpy_new"] = time.perf_counter() - t
  t = time.perf_counter()
  for c, p in zip(copies, parts):
    np.copyto(c, p)
  out["memcpy_reused"] = time.perf_counter() - t
  t = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    for c, e in zip(copies, record.entries):
      f.seek(e.offset)
      f.readinto(memoryview(c))
  out["read"] = time.perf_counter() - t
  return out


def _raw_transfer(strategy, nbytes):
  """(seconds, this process's CPU seconds) to send `nbytes` from worker 0 to worker 1 over one TCP socket.

  The floor of peer recovery. Seconds: the receiver's, from accepting the
  connection to holding every byte in a preallocated buffer (0 on the
  sender); the ports are agreed with one all-reduce, as the side channel
  agrees on them.
  """
  import socket  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdp import cluster  # pylint: disable=g-import-not-at-top
  me = cluster.resolve(strategy)
  server = socket.create_server(("localhost", 0))
  ports = cluster.gather([server.getsockname()[1]], strategy)[:, 0]
  if me.index == 0:
    data = np.ones(nbytes, np.uint8)
    cpu = time.process_time()
    with socket.create_connection(("localhost", int(ports[1]))) as sock:
      sock.sendall(memoryview(data))
    cpu = time.process_time() - cpu
    cluster.agree(0, "max", strategy)
    return 0.0, cpu
  conn, _ = server.accept()
  buf = bytearray(nbytes)
  view, got = memoryview(buf), 0
  t, cpu = time.perf_counter(), time.process_time()
  while got < nbytes:
    got += conn.recv_into(view[got:])
  seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
  conn.close()
  cluster.agree(0, "max", strategy)
  return seconds, cpu


def _write(obj, per_worker=False):
  path = FLAGS.result
  if per_worker:
    path += f"-w{os.environ.get('TFDP_WORKER_INDEX', '0')}"
  with open(path, "w") as f:
    json.dump(obj, f)


# --- Parent ---------------------------------------------------------------


def _cmd(role, result, work, **extra):
  cmd = [sys.executable, os.path.abspath(__file__), f"--role={role}", f"--result={result}",
         f"--work={work}", f"--local_root={FLAGS.local_root}", f"--fit_steps={FLAGS.fit_steps}",
         f"--fit_setup={FLAGS.fit_setup}"]
  return cmd + [f"--{k}={v}" for k, v in extra.items()]


def _drop_caches():
  """Drops the page cache (root only): the next read of the persistent tier comes from disk."""
  subprocess.call(["sync"])
  try:
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError as e:
    logging.warning("cannot drop the page cache (%s): 'cold' is warm", e)
    return False


def _child(cmd, log, env=None, handshake=None):
  """Runs one child; with `handshake`, calls it between the child's set-up and its restore."""
  env = bench_common.worker_env(dict(env or {}, BENCH_T0=repr(time.time())))
  if handshake is None:
    code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
  else:
    env["BENCH_HANDSHAKE"] = "1"
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    for line in proc.stdout:
      log.write(line)
      if line.strip() == "ready":
        handshake()
        proc.stdin.write("go\n")
        proc.stdin.flush()
    code = proc.wait()
  log.flush()
  if code != 0:
    raise RuntimeError(f"{' '.join(cmd[2:4])} failed (exit {code}); see {log.name}")


def _launch(cmd, log, n=2):
  from tfdp import launch  # pylint: disable=g-import-not-at-top
  env = bench_common.worker_env({"BENCH_T0": repr(time.time())})
  code = launch.launch(cmd, n, env=env, out=log, grace_seconds=5)
  log.flush()
  if code != 0:
    raise RuntimeError(f"{' '.join(cmd[2:4])} failed under tfdp-launch (exit {code}); "
                       f"see {log.name}")


def _read(result, n=1):
  out = []
  for i in range(n):
    with open(f"{result}-w{i}") as f:
      out.append(json.load(f))
  return out


def _variants():
  """(name, variant, interval) of each throughput run: the local variants once per --local_every."""
  out = []
  for v in (v for v in _FIT_VARIANTS if v in FLAGS.fit_variants):
    if v in ("local", "local_no_position"):
      out += [(f"{v}@{every}", v, every) for every in FLAGS.local_every]
    else:
      out.append((v, v, str(FLAGS.persistent_every)))
  return out


# Targets of issue 45, against the same callback never saving (backup_nosave).
_GOALS = {"free": {"local@1": 0.90, "local@5": 0.97, "local@auto": 0.98, "persistent_async": 0.98},
          "busy": {"local@1": 0.80, "persistent_async": 0.95}}


def _throughput_part(base, log):
  """Every setup of --fit_cores, its variants interleaved in rounds."""
  return {cores: _throughput_setup(base, log, cores) for cores in FLAGS.fit_cores}


def _throughput_setup(base, log, cores):
  order = _variants()
  names = [name for name, _, _ in order]
  rates = {n: [] for n in names}
  save_ms = {n: [] for n in names}
  other_ms = {n: [] for n in names}
  skipped = {n: [] for n in names}
  interval = {n: [] for n in names}
  whole = {n: [] for n in names}
  state = None
  for rnd in range(FLAGS.rounds):
    for name, variant, every in order[rnd % len(order):] + order[:rnd % len(order)]:
      work = tempfile.mkdtemp(prefix=f"fit-{variant}-", dir=base)
      result = os.path.join(work, "result")
      env = ({"TFDP_COMPAT_DISABLE": "fit_data_state"} if variant == "local_no_position"
             else None)
      _child(_cmd("fit", result, work, variant=variant, every=every, cores=cores), log, env=env)
      with open(result) as f:
        r = json.load(f)
      rates[name].append(bench_common.median(r["rates"]))
      save_ms[name].append(r["save_step_ms"])
      other_ms[name].append(r["other_step_ms"])
      skipped[name].append(r["local_saves_skipped"])
      interval[name].append(r["local_interval"])
      whole[name].append(r["whole_states"])
      state = r["state_bytes"]
      shutil.rmtree(work, ignore_errors=True)
      _log(f"throughput {cores} round {rnd} {name}: {rates[name][-1]:.2f} steps/s")
  med = {n: bench_common.median(rs) for n, rs in rates.items()}
  rows = [{"variant": n, "steps_per_s": med[n], "save_step_ms": bench_common.median(save_ms[n]),
           "other_step_ms": bench_common.median(other_ms[n]), "vs_none": med[n] / med["none"],
           "vs_nosave": med[n] / med[_NOSAVE] if _NOSAVE in med else None,
           "interval": " ".join(str(i) for i in interval[n] if i is not None) or "-",
           "skipped": " ".join(str(k) for k in skipped[n] if k is not None) or "-",
           "whole_states": " ".join(str(k) for k in whole[n]),
           "runs": " ".join(f"{x:.1f}" for x in rates[n])} for n in names]
  setup = ("the user's own MirroredStrategy over 2 logical CPUs, MLP, batch 64, "
           "shuffle(2048) of uint8 images" if FLAGS.fit_setup == "mirrored" else
           f"conv net, no strategy, batch {_BATCH}")
  where = ("a free core (training in one thread)" if cores == "free"
           else "busy cores (TF's default threads)")
  print(f"\nthroughput, {where}: plain model.fit, {setup}, "
        f"{state / _MB:.1f} MB of state, {FLAGS.fit_steps} steps a run, persistent saves "
        f"every {FLAGS.persistent_every} steps, local saves every N = {', '.join(FLAGS.local_every)} "
        f"('auto': budget {FLAGS.overhead:.0%}), median of {FLAGS.rounds} interleaved runs")
  print(bench_common.table(rows, [
      ("variant", "variant", None), ("steps_per_s", "steps/s", "{:.2f}"),
      ("vs_none", "vs none", "{:.3f}"), ("vs_nosave", f"vs {_NOSAVE}", "{:.3f}"),
      ("save_step_ms", "median ms, saving steps", "{:.1f}"),
      ("other_step_ms", "median ms, other steps", "{:.1f}"),
      ("interval", "local interval at the end", None),
      ("skipped", "local saves skipped", None),
      ("whole_states", "whole data positions taken", None), ("runs", "per-run steps/s", None)]))
  # The same input path and callbacks with no save: what the saves alone cost.
  # Against "none" a ratio also carries the callback's own per-step work and
  # the difference between tfdp's input path (a backup's checkpointable
  # iterator) and Keras's own.
  ref = _NOSAVE if _NOSAVE in med else "none"
  targets = {n: {"min": g, "ratio": med[n] / med[ref], "against": ref,
                 "met": med[n] / med[ref] >= g}
             for n, g in _GOALS.get(cores, {}).items() if n in med}
  print("; ".join(f"{n}/{ref} {t['ratio']:.3f} (target >= {t['min']}: "
                  f"{'MET' if t['met'] else 'MISSED'})" for n, t in targets.items()))
  return {"setup": FLAGS.fit_setup, "cores": cores, "rows": rows, "runs": rates,
          "state_bytes": state, "local_saves_skipped": skipped,
          "local_interval": interval, "targets": targets}


def _restore_row(samples, **row):
  for key in dict.fromkeys(k for s in samples for k in s):
    row[key] = bench_common.median([s[key] for s in samples if key in s])
  return row


# Phases of a restore call on the restoring thread (tfdp.checkpoint.local.phases),
# in order; the inner ones run inside `wait` on the side channel's threads.
_PHASES = ("held", "agree", "index", "before_restore", "map", "check", "views", "plan",
           "tensors", "assign", "per_worker", "send", "wait", "commit")
_INNER_PHASES = ("allocate", "recv", "land_behind", "land_check", "land_write", "land_tail")


def _timings(ws):
  """Seconds of one restore (the slowest worker): to the first step, excluding a handshake wait.

  With the slowest worker's phases (`phase_<name>_s`, `phase_other_s`: the
  rest of its restore call) and their floors in its process (`floor_<name>_s`);
  those of worker i, when it is not the slowest, with `w<i>_` before them.
  """
  slowest = max(ws, key=lambda w: w["restored"] - w["go"])
  out = {"to_first_step_s": max((w["ready"] - w["start"]) + (w["first_step"] - w["go"])
                                for w in ws),
         "restore_s": slowest["restored"] - slowest["go"],
         "tf_restore_again_s": max(w["tf_restore_again_s"] for w in ws)}
  for i, w in enumerate(ws):
    tag = "" if w is slowest else f"w{i}_"
    phases = w.get("phases", {})
    for name, seconds in phases.items():
      out[f"{tag}phase_{name}_s"] = seconds
    out[f"{tag}phase_other_s"] = (w["restored"] - w["go"]) - sum(
        phases.get(p, 0.0) for p in _PHASES)
    for name, seconds in w.get("floors", {}).items():
      out[f"{tag}floor_{name}_s"] = seconds
  return out


def _print_phases(rows, keys, workers=1):
  """One line per row and worker: where its restore call's time went, each phase beside its floor."""
  floors = {"map": "map", "check": "crc32c", "tensors": "memcpy_new", "recv": "raw_transfer"}
  print("  phases of each worker's restore call, s (floor in the same process):")
  for r in rows:
    for i in range(workers):
      tag = f"w{i}_" if any(k.startswith(f"w{i}_") for k in r) else ""
      label = " ".join(str(r[k]) for k in keys) + (
          f" worker {i}{'' if tag else ' (the slowest)'}" if workers > 1 else "")
      total = r["restore_s"] if not tag else r[f"{tag}phase_other_s"] + sum(
          r.get(f"{tag}phase_{p}_s", 0.0) for p in _PHASES)
      parts = []
      for name in _PHASES + _INNER_PHASES + ("other",):
        if f"{tag}phase_{name}_s" not in r:
          continue
        text = f"{name} {r[f'{tag}phase_{name}_s']:.3f}"
        floor = r.get(f"{tag}floor_{floors.get(name)}_s", r.get(f"{floors.get(name)}_s"))
        if floor is not None:
          text += f" ({floor:.3f})"
        parts.append(text)
      extra = [f"{k} {r[f'{tag}floor_{k}_s']:.3f}" for k in ("memcpy_reused", "read")
               if f"{tag}floor_{k}_s" in r]
      print(f"  {label}: restore call {total:.3f} = " + ", ".join(parts)
            + (f"; floors: {', '.join(extra)}" if extra else ""))


def _restore_part(base, log, sizes):
  """Single process: local vs persistent, each after a page cache drop (cold) and not (warm).

  tmpfs keeps the local tier through a drop; what else the drop evicts (the
  parts of TF and Python not yet read) shows in "local, dropped".
  """
  rows = []
  variants = (("local", True), ("local", False), ("persistent", True), ("persistent", False))
  for mb in sizes:
    work = os.path.join(base, f"restore-{mb}")
    os.makedirs(work)
    local = os.path.join(FLAGS.local_root, f"tfdp_bench_tiers_{os.getpid()}_{mb}")
    try:
      _child(_cmd("make", os.path.join(work, "make"), work, mb=mb, local_dir=local), log)
      samples = {v: [] for v in variants}
      for rep in range(FLAGS.restore_reps):
        for tier, cold in variants:
          result = os.path.join(work, f"r-{tier}-{cold}-{rep}")

          def hook(cold=cold):
            if cold and FLAGS.drop_caches:
              _drop_caches()

          _child(_cmd("restore", result, work, mb=mb, variant=tier, local_dir=local), log,
                 handshake=hook)
          ws = _read(result)
          if ws[0]["tier"] != tier:
            raise RuntimeError(f"restored from {ws[0]['tier']}, wanted {tier}")
          samples[(tier, cold)].append(_timings(ws))
          _log(f"restore {mb} MB {tier} {'cold' if cold else 'warm'}: {samples[(tier, cold)][-1]}")
      for (tier, cold), ss in samples.items():
        cache = ("dropped (tmpfs keeps it)" if tier == "local" else "dropped: cold") if cold \
            else "warm (not dropped)"
        rows.append(_restore_row(ss, state_MB=mb, tier=tier, cache=cache,
                                 cold=cold, reps=len(ss)))
    finally:
      shutil.rmtree(local, ignore_errors=True)
      shutil.rmtree(work, ignore_errors=True)
  print(f"\nrestore: one process, float32 variables of {_VAR_MB} MB; local = "
        f"{FLAGS.local_root} (tmpfs), persistent = {base} (VM disk); page cache dropped "
        f"with `sync; echo 3 > /proc/sys/vm/drop_caches` (as root) after the child's "
        f"imports, before its restore; medians of {FLAGS.restore_reps}")
  print(bench_common.table(rows, [
      ("state_MB", "MB", "{}"), ("tier", "tier", None), ("cache", "page cache", None),
      ("to_first_step_s", "start to 1st step s", "{:.2f}"),
      ("restore_s", "restore call s", "{:.3f}"),
      ("tf_restore_again_s", "TF restore again s", "{:.3f}")]))
  _print_phases([r for r in rows if r["tier"] == "local"], ("state_MB", "tier", "cache"))
  ratios = {}
  for mb in sizes:
    by = {(r["tier"], r["cold"]): r for r in rows if r["state_MB"] == mb}
    for cold in (True, False):
      loc, p = by[("local", cold)], by[("persistent", cold)]
      tag = f"{mb}MB_{'cold' if cold else 'warm'}"
      ratios[tag] = {"restore_x": p["restore_s"] / loc["restore_s"],
                     "to_first_step_x": p["to_first_step_s"] / loc["to_first_step_s"]}
      ratios[tag]["met"] = ratios[tag]["restore_x"] >= 3
      print(f"  {mb} MB persistent / local, both {'dropped' if cold else 'warm'}: restore call "
            f"{ratios[tag]['restore_x']:.2f}x, start to first step "
            f"{ratios[tag]['to_first_step_x']:.2f}x (target local >= 3x faster, restore "
            f"call: {'MET' if ratios[tag]['met'] else 'MISSED'})")
  return {"rows": rows, "ratios": ratios}


def _peer_part(base, log, sizes):
  """2 workers: both local copies vs worker 1's deleted (peer recovery) vs the persistent tier."""
  rows = []
  for mb in sizes:
    work = os.path.join(base, f"peer-{mb}")
    os.makedirs(work)
    local = os.path.join(FLAGS.local_root, f"tfdp_bench_tiers_{os.getpid()}_peer{mb}")
    reps = FLAGS.peer_reps if mb <= 256 else 1
    try:
      t = time.perf_counter()
      _launch(_cmd("make", os.path.join(work, "make"), work, mb=mb, local_dir=local), log)
      _log(f"peer {mb} MB: saved in {time.perf_counter() - t:.1f} s")
      samples = {tier: [] for tier in FLAGS.peer_tiers}
      raw = []
      for rep in range(reps):
        # Peer recovery writes worker 1's copy back, so "local" can follow it.
        for tier in FLAGS.peer_tiers:
          if tier == "peer":
            shutil.rmtree(os.path.join(local, "worker-1"))
          result = os.path.join(work, f"p-{tier}-{rep}")
          _launch(_cmd("restore", result, work, mb=mb, variant=tier, local_dir=local,
                       peer_probe=FLAGS.peer_probe), log)
          ws = _read(result, 2)
          if tier == "peer" and FLAGS.peer_probe:
            _print_probe(ws)
            print(f"    raw TCP of the same bytes: {max(w['raw_transfer_s'] for w in ws):.3f} s, "
                  f"CPU of both processes {sum(w['raw_transfer_cpu_s'] for w in ws):.3f} s")
          if any(w["tier"] != tier for w in ws):
            raise RuntimeError(f"restored from {[w['tier'] for w in ws]}, wanted {tier}")
          samples[tier].append(_timings(ws))
          if tier == "peer":
            raw.append(max(w["raw_transfer_s"] for w in ws))
          _log(f"peer {mb} MB {tier}: {samples[tier][-1]}")
      for tier, ss in samples.items():
        rows.append(_restore_row(ss, state_MB=mb, tier=tier, reps=len(ss)))
        if tier == "peer":
          rows[-1]["raw_transfer_s"] = bench_common.median(raw)
    finally:
      shutil.rmtree(local, ignore_errors=True)
      shutil.rmtree(work, ignore_errors=True)
  print("\npeer: 2 workers (tfdp-launch, MultiWorkerMirroredStrategy, one host), page cache "
        "warm; 'peer' = worker 1's local dir deleted before the start, it gets the state "
        "from worker 0 by collectives; times of the slower worker; start = the launch")
  print(bench_common.table(rows, [
      ("state_MB", "MB", "{}"), ("tier", "restore from", None), ("reps", "runs", "{}"),
      ("to_first_step_s", "launch to 1st step s", "{:.2f}"),
      ("restore_s", "restore call s", "{:.3f}"),
      ("tf_restore_again_s", "TF restore again s", "{:.3f}")]))
  _print_phases([r for r in rows if r["tier"] != "persistent"], ("state_MB", "tier"), workers=2)
  ratios = {}
  for mb in sizes:
    by = {r["tier"]: r for r in rows if r["state_MB"] == mb}
    if "peer" not in by:
      continue
    raw = by["peer"]["raw_transfer_s"]
    # The receiver's wait: from the agreement that lets the holder send to the
    # copy checked in its slot (the holder's connection, handshake, record and
    # bytes; allocate, recv, the check as they land).
    wait = max(v for k, v in by["peer"].items() if k.endswith("phase_wait_s"))
    r = ratios[f"{mb}MB"] = {"raw_transfer_s": raw, "transfer_s": wait,
                             "transfer_vs_raw": wait / raw if raw else None}
    text = (f"  {mb} MB against a raw TCP transfer of the same bytes {raw:.3f} s: the transfer "
            f"(the receiver's wait, agreement to the copy checked in its slot) {wait:.3f} s = "
            f"{r['transfer_vs_raw'] or 0:.2f}x (target <= 2: "
            f"{'MET' if (r['transfer_vs_raw'] or 9) <= 2 else 'MISSED'})")
    if "local" in by:
      extra = by["peer"]["restore_s"] - by["local"]["restore_s"]  # Getting the bytes.
      r.update(peer_vs_local=by["peer"]["restore_s"] / by["local"]["restore_s"],
               peer_extra_s=extra, peer_extra_vs_raw=extra / raw if raw else None)
      text += (f"; restore call peer/local {r['peer_vs_local']:.2f}x, peer - local "
               f"{extra:.3f} s = {r['peer_extra_vs_raw'] or 0:.2f}x raw")
    if "persistent" in by:
      r["persistent_vs_peer"] = by["persistent"]["restore_s"] / by["peer"]["restore_s"]
      text += f", persistent(warm)/peer {r['persistent_vs_peer']:.2f}x"
    print(text)
  return {"rows": rows, "ratios": ratios}


def _print_probe(ws):
  """Each worker's timeline of the transfer (from the agreement), its sendfile pieces and threads."""
  t0 = min(w["probe"]["stamps"]["agreed"] for w in ws if "agreed" in w["probe"]["stamps"])
  cpu = []  # The holder's over its send, the receiver's over its receive.
  for i, w in enumerate(ws):
    probe = w["probe"]
    line = ", ".join(f"{k} +{v - t0:.3f}" for k, v in sorted(probe["stamps"].items(),
                                                               key=lambda kv: kv[1]))
    print(f"  probe worker {i}: {line}")
    if "sendfile" in probe:
      print(f"    sendfile: {probe['sendfile']}")
    if "recv_calls" in probe:
      print(f"    recv: {probe['recv_calls']} calls, {probe['recv_bytes']} bytes")
    for thread, d in probe.get("threads", {}).items():
      print(f"    thread {thread}: {d}")
    for name, window in probe["windows"].items():
      if "seconds" not in window:
        continue
      if name == ("transfer" if "send_start" in probe["stamps"] else "receive"):
        cpu.append(window["machine"]["process_cpu"])
      print(f"    {name} window {window['seconds']:.3f} s; machine: {window['machine']}")
      busy = sorted(window["per_thread"].items(), key=lambda kv: -kv[1]["cpu"])
      for thread, d in busy[:12]:
        print(f"      {thread}: {d}")
  print(f"    peer transfer: CPU of both processes {sum(cpu):.3f} s (holder sending, receiver "
        "receiving)")


def _chaos_plan(seed, steps):
  """5 SIGKILLs at seeded, increasing steps in [10, steps - 10), of random workers.

  A step kill fires at the end of the first step at or past it (after that
  step's saves, as a failure during the next step's compute would), so a kill
  below the step the previous restart restored would fire at once: increasing
  steps.
  """
  rng = random.Random(seed)
  kills = sorted(rng.sample(range(10, steps - 10), 5))
  return {str(i): {"worker": rng.randrange(2), "step": s} for i, s in enumerate(kills)}


def _chaos_part(base):
  bench_common.ensure_repo_on_path()
  from tests.workers import ft_common  # pylint: disable=g-import-not-at-top
  plan = _chaos_plan(FLAGS.chaos_seed, ft_common.STEPS)
  local = os.path.join(FLAGS.local_root, f"tfdp_bench_tiers_{os.getpid()}_chaos")
  configs = {
      f"local@{every}": ["--checkpoint_every_steps=100", f"--local_checkpoint_every_steps={every}",
                         f"--local_checkpoint_dir={local}"] for every in ("1", "auto")}
  configs["persistent_only"] = ["--checkpoint_every_steps=100"]
  rows, lines = [], {}
  for name, train_flags in configs.items():
    model_dir = os.path.join(base, f"chaos-{name}")
    t = time.perf_counter()
    try:
      code, out = ft_common.run_job(
          model_dir, os.path.join(base, f"chaos-{name}.log"), train_flags,
          env=ft_common.env(FT_CHAOS_PLAN=json.dumps(plan)), max_restarts=5, hang_timeout=60)
    finally:
      shutil.rmtree(local, ignore_errors=True)
    wall = time.perf_counter() - t
    if code != 0:
      raise RuntimeError(f"chaos job {name} failed (exit {code}):\n{out[-3000:]}")
    lines[name] = next((l for l in out.splitlines() if "[tfdp-launch] goodput " in l), None)
    with open(os.path.join(model_dir, "goodput.json")) as f:
      summary = json.load(f)
    restarts = summary["restarts"]
    tiers = [a.get("restored_tier") for a in summary.get("attempts", [])]
    rows.append({"config": name, "wall_s": wall, "restarts": restarts,
                 "recomputed_steps": summary["recomputed_steps"],
                 "per_failure": summary["recomputed_steps"] / max(1, restarts),
                 "goodput": _goodput_percent(lines[name]), "tiers": " ".join(map(str, tiers))})
    _log(f"chaos {name}: {lines[name]}")
    shutil.copy(os.path.join(model_dir, "goodput.json"),
                os.path.join(base, f"chaos-{name}.goodput.json"))
  print(f"\nchaos: tests/workers/ft_train.py job ({ft_common.STEPS} steps, cnn, 2 workers), "
        f"max_restarts=5, hang_timeout=60, SIGKILLs {json.dumps(plan)}")
  for name, line in lines.items():
    print(f"  {name}: {line}")
  print(bench_common.table(rows, [
      ("config", "config", None), ("restarts", "restarts", "{}"),
      ("recomputed_steps", "steps recomputed", "{}"),
      ("per_failure", "recomputed per failure", "{:.1f}"), ("goodput", "goodput %", "{}"),
      ("wall_s", "wall s", "{:.0f}"), ("tiers", "restored tier per attempt", None)]))
  every_step = rows[0]["per_failure"]
  print(f"recomputed steps per failure: local every step {every_step:.1f} (target <= 1: "
        f"{'MET' if every_step <= 1 else 'MISSED'}), local auto {rows[1]['per_failure']:.1f}, "
        f"persistent only {rows[2]['per_failure']:.1f}")
  return {"plan": plan, "rows": rows, "goodput_lines": lines,
          "target": {"max": 1, "met": every_step <= 1}}


def _goodput_percent(line):
  found = re.search(r"goodput ([\d.]+)%", line or "")
  return found.group(1) if found else None


def _part(name, fn, results):
  before = bench_common.load_average()
  t = time.perf_counter()
  _log(f"part {name}: load average {before}")
  results[name] = fn()
  results[name]["load_avg_before"] = before
  results[name]["load_avg_after"] = bench_common.load_average()
  results[name]["wall_s"] = time.perf_counter() - t
  print(f"part {name}: {results[name]['wall_s']:.0f} s, load average before {before}, "
        f"after {results[name]['load_avg_after']}", flush=True)


def main(argv):
  del argv
  roles = {"fit": _fit_child, "make": _make_child, "restore": _restore_child}
  if FLAGS.role:
    roles[FLAGS.role]()
    return
  if FLAGS.smoke:
    FLAGS.rounds, FLAGS.fit_steps, FLAGS.restore_reps, FLAGS.peer_reps = 1, 40, 1, 1
    FLAGS.restore_mb, FLAGS.peer_mb = ["16"], ["16"]
    FLAGS.fit_variants, FLAGS.local_every = ["none", "local"], ["auto"]
    FLAGS.fit_cores = FLAGS.fit_cores[-1:]
    FLAGS.parts = [p for p in FLAGS.parts if p != "chaos"]
  machine = bench_common.machine()
  _log(f"machine: {json.dumps(machine)}")
  base = FLAGS.dir or tempfile.mkdtemp(prefix="tfdp_bench_tiers_")
  os.makedirs(base, exist_ok=True)
  results = {}
  log = open(os.path.join(base, "log.txt"), "w")  # pylint: disable=consider-using-with
  _log(f"children's output: {log.name}")
  parts = {
      "throughput": lambda: _throughput_part(base, log),
      "restore": lambda: _restore_part(base, log, [int(s) for s in FLAGS.restore_mb]),
      "peer": lambda: _peer_part(base, log, [int(s) for s in FLAGS.peer_mb]),
      "chaos": lambda: _chaos_part(base)}
  try:
    for name in FLAGS.parts:
      _part(name, parts[name], results)
  finally:
    log.close()
    load_end = bench_common.load_average()
    print(f"\nmachine: {machine['nproc']} CPUs, {machine['cpu_model']}, {machine['ram_gib']} GiB, "
          f"TF {machine['tensorflow']}, Keras {machine['keras']}, {machine['date_utc']}; "
          f"load average start {machine['load_avg_start']}, end {load_end}")
    bench_common.write_json(FLAGS.out, {
        "results": results, "machine": machine, "load_avg_end": load_end,
        "smoke": FLAGS.smoke, "parts": FLAGS.parts, "dir": base,
        "command": " ".join(sys.argv)})
    if not FLAGS.dir:
      shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
