"""Where a saving step's time goes: the issue-45 user script, one variant per process, one JSON line.

    python scripts/bench_step_cost.py VARIANT CORES STEPS [ROOT] [--paired=B] [--layers=N] [--cow=1]

A user's plain script: `MirroredStrategy` over 2 logical CPUs, a 1.41M-
parameter MLP with Adam (16.9 MB of state), `shuffle(2048)`, `model.fit`
with `tfdp.callbacks.BackupAndRestore(save_freq=False, ...)`.

VARIANT:
  never          the callback never saves (the baseline);
  every1, every5 local saves every 1 / 5 steps; auto: "auto" (2% budget);
  async50        async persistent saves every 50 steps (save_freq=50);
  every1_nowrite every step, the local writer replaced by nothing (what the
                 training thread pays alone);
  every1_nocrc   every step without the CRC32C (what the checksum costs);
  floor1, floor5 the callback never saving, and at every step (every 5th
                 step) a thread copies and checksums a buffer of the
                 state's size: the floor of any local save every step
                 (every 5) on this machine (its copy and CRC32C on the
                 other core, nothing of tfdp's).
CORES: free (training in one thread: intra- and inter-op threads 1, a core
  left free as on a GPU host) or busy (TF's defaults: both cores train).
--layers=N: N more Dense(10) layers at the end (6 more tensors each with
  Adam's slots): a model of many tensors, as real models are (ResNet-50 has
  about 480 to save), for the cost per tensor.
--cow=1: reports `cow_steps`, the steps after step 100 at which TF copied
  the first layers' variables before updating them (their buffers moved):
  a snapshot the writer still held (copy-on-write, on the training side).
  It reads those variables at every batch begin (a few small ops a step).
ROOT: where the backup goes (default /tmp/b45); the local tier goes to its
  default directory (/dev/shm).

Prints steps/s after step 100; the callback's wall and CPU milliseconds per
step on the training thread (its `on_train_batch_end`, saves included); the
local writer thread's CPU per save; the median step's time from its batch's
begin to the end of its callbacks (`train_fn_ms`: `fit`'s train function,
then the callbacks, a save at that step included); the process's CPU
seconds. `scripts/bench_tiers.py --parts=throughput` runs the same
comparison as interleaved rounds; this script is its breakdown.

--paired=B: after step 100, the same process alternates blocks of B steps
with the saves (or the floor's copy) off (the callback never saving: its
`LocalTier.due`, for async50 its cadence, answering no) and on. For async50
with B=50 each block on holds one persistent save, at its first step.
`paired_ratio` is the median over the pairs of (the off block's time / the
on block's): the ratio to never saving without the spread between
processes (one variant's separate runs differ by up to 25% here), as a
block and the next share the process, its memory and the machine's state
of the moment.
"""
import json
import os
import sys
import threading
import time

flags = {a[2:].split("=", 1)[0]: int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--")}
argv = [a for a in sys.argv if not a.startswith("--")]
paired, layers, cow = flags.get("paired"), flags.get("layers", 0), flags.get("cow")
variant, cores, steps = argv[1], argv[2], int(argv[3])
root = os.path.join(argv[4] if len(argv) > 4 else "/tmp/b45", f"{variant}-{os.getpid()}")
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
if cores == "free":
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # pylint: disable=g-import-not-at-top,wrong-import-position
import tfdp  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp.callbacks import backup as backup_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp.checkpoint import tiers as tiers_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp.checkpoint.local import tier as tier_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

strategy = tfdp.make_strategy(cpu_replicas=2)
if variant.endswith("_nocrc"):
  from tfdp.checkpoint.format import checksum  # pylint: disable=g-import-not-at-top
  checksum.extend = lambda crc, buf: 0
if variant.endswith("_nowrite"):
  tier_lib.LocalTier._write = lambda self, *a, **k: None  # pylint: disable=protected-access
writer_cpu = []
real_write = tier_lib.LocalTier._write  # pylint: disable=protected-access


def timed_write(self, *a, **k):
  start = time.thread_time()
  try:
    return real_write(self, *a, **k)
  finally:
    writer_cpu.append(time.thread_time() - start)


tier_lib.LocalTier._write = timed_write  # pylint: disable=protected-access
real_due = tier_lib.LocalTier.due
stamps = []


def off_block() -> bool:
  """With --paired: whether the step now is in an off block (the even blocks after step 100)."""
  done = len(stamps)
  return bool(paired) and done >= 100 and ((done - 100) // paired) % 2 == 0


def paired_due(self, step):
  """No local save in an off block."""
  return not off_block() and real_due(self, step)


tier_lib.LocalTier.due = paired_due
persistent_steps = []
real_persistent = tiers_lib.Tiers._save_persistent  # pylint: disable=protected-access


def counted_persistent(self, snapshot, step, *a, **k):
  persistent_steps.append(len(stamps))
  return real_persistent(self, snapshot, step, *a, **k)


tiers_lib.Tiers._save_persistent = counted_persistent  # pylint: disable=protected-access
spent = [0.0, 0.0]
real_end = backup_lib.BackupAndRestore.on_train_batch_end


def timed_end(self, batch, logs=None):
  wall, cpu = time.perf_counter(), time.thread_time()
  out = real_end(self, batch, logs)
  spent[0] += time.perf_counter() - wall
  spent[1] += time.thread_time() - cpu
  return out


backup_lib.BackupAndRestore.on_train_batch_end = timed_end
N = 2048
x = np.random.default_rng(0).normal(size=(N, 512)).astype("float32")
y = np.random.default_rng(1).integers(0, 10, N)
ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=1).repeat().batch(64)
keras.utils.set_random_seed(0)
with strategy.scope():  # 1.41M parameters: 16.9 MB with Adam's two slots.
  model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(856, activation="relu"), keras.layers.Dense(10)]
                           + [keras.layers.Dense(10) for _ in range(layers)])
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
floor_every = int(variant[5:]) if variant.startswith("floor") else None
every = {"never": None, "every5": 5, "auto": "auto", "async50": None}.get(
    variant, None if floor_every else 1)
kw = dict(save_freq=50, async_save=True) if variant == "async50" else dict(save_freq=False)
if every is not None:
  kw.update(local_checkpoint_every_steps=every)
cb = tfdp.callbacks.BackupAndRestore(os.path.join(root, "backup"), **kw)
if variant == "async50" and paired:  # Off blocks: the persistent saves not due.
  real_cadence_due = cb._cadence.due  # pylint: disable=protected-access
  cb._cadence.due = lambda *a, **k: not off_block() and real_cadence_due(*a, **k)  # pylint: disable=protected-access


due = threading.Semaphore(0)


def floor_writer():
  from tfdp.checkpoint.format import checksum  # pylint: disable=g-import-not-at-top
  src = np.ones(sum(int(np.prod(v.shape)) for v in model.weights) * 3, np.float32)
  dst = np.empty_like(src)
  while True:
    due.acquire()
    start = time.thread_time()
    np.copyto(dst, src)
    checksum.value(dst)
    writer_cpu.append(time.thread_time() - start)


if floor_every:
  threading.Thread(target=floor_writer, daemon=True).start()


begins = []
buffers = []  # With --cow: the first layers' variables' buffer addresses at each batch begin.


def buffer_addresses():
  """Where the first two layers' variables' bytes are now (one replica's copy; read, then let go)."""
  out = []
  for v in model.weights[:4]:
    value = tf.convert_to_tensor(getattr(v, "value", v))
    out.append(value._numpy().ctypes.data)  # pylint: disable=protected-access
  return tuple(out)


class Stamp(keras.callbacks.Callback):

  def on_train_batch_begin(self, batch, logs=None):
    begins.append(time.perf_counter())
    if cow:
      buffers.append(buffer_addresses())

  def on_train_batch_end(self, batch, logs=None):
    stamps.append(time.perf_counter())
    if floor_every and len(stamps) % floor_every == 0 and not off_block():
      due.release()


t0 = time.process_time()
model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[cb, Stamp()])
cpu = time.process_time() - t0
st = stamps[100:]
params = sum(int(np.prod(v.shape)) for v in model.weights)
ratios = []
if paired:  # Block k: from the batch begin of step 100 + k*B to that of step 100 + (k+1)*B.
  # Batch begins, not ends: a step's saves run in its callbacks, before its
  # end's stamp, so a block of end stamps would hand its first save to the
  # block before it (one save in B: with async50, the block's only save).
  ends = begins[100::paired]
  blocks = [b - a for a, b in zip(ends, ends[1:])]
  ratios = [off / on for off, on in zip(blocks[0::2], blocks[1::2])]
print(json.dumps({
    "variant": variant, "cores": cores, "steps_per_s": round((len(st) - 1) / (st[-1] - st[0]), 2),
    "callback_ms_per_step": round(1000 * spent[0] / len(stamps), 3),
    "callback_cpu_ms_per_step": round(1000 * spent[1] / len(stamps), 3),
    "writer_cpu_ms_per_save": round(1000 * float(np.median(writer_cpu)), 2) if writer_cpu else None,
    "train_fn_ms": round(1000 * float(np.median(np.subtract(stamps[100:], begins[100:]))), 2),
    "paired_ratio": round(float(np.median(ratios)), 4) if ratios else None,
    "pairs": len(ratios),
    "saves_written": len(writer_cpu), "persistent_at": persistent_steps[:12],
    "process_cpu_s": round(cpu, 2),
    "state_mb": round(params * 4 * 3 / 1e6, 1), "layers": layers,
    **({"cow_steps": sum(a != b for a, b in zip(buffers[100:], buffers[101:])),
        "of_steps": len(buffers[101:])} if cow else {})}), flush=True)
