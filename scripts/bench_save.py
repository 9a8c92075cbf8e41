"""What one save costs, each cost beside its physical floor measured in the same process.

For a local-tier save, an async persistent save and a sync persistent save
of the same state (float32 variables, plus optionally a data position: the
iterator of a tf.data pipeline with a shuffle buffer, as per-worker state):

  blocked     wall time the training thread spends in the save call
              (median over --saves saves, a training update between them),
              beside a memcpy of the same bytes into a reused buffer;
  next        what the training update --step_ms after a save costs more
  update      than one without a save in flight: TF copies a variable's
              buffer before updating it while the writer still holds an
              alias of it (copy-on-write). An explicit copy into the slot in
              the step would cost the memcpy instead;
  writer CPU  the CPU time of the writer thread per save (its thread clock;
              TF's SaveV2 runs on the calling thread), beside the local
              tier's floor, a memcpy plus the CRC32C (tfdp's library) of the same bytes
              (goal: at most 1.5x), and beside the CPU of a raw write of
              the same bytes (one `os.writev` + fsync);
  memory      the memory the saves hold: a local save's two slots (mapped
              shared memory) plus what the measured saves add to the peak
              resident memory (VmHWM after them minus before, after two
              warm-up saves; /proc/self/clear_refs resets it), beside the
              state's bytes (goal: at most 2x).

Run: .venv/bin/python scripts/bench_save.py [--mb=16] [--data_position] [--out=FILE]
"""

import json
import os
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("mb", ["4", "16", "64"], "State sizes in MB (float32 variables of 1 MB each).")
flags.DEFINE_integer("saves", 12, "Saves measured per kind (after 2 warm-up saves).")
flags.DEFINE_list("kinds", ["local", "async", "sync"], "Saves to measure.")
flags.DEFINE_bool("data_position", True, "Also save a tf.data iterator's position (per worker).")
flags.DEFINE_integer("shuffle", 10_000, "Shuffle buffer of the data position's pipeline.")
flags.DEFINE_string("dir", None, "Persistent tier (default: a temp dir on the disk).")
flags.DEFINE_string("local_root", "/dev/shm", "Local tier (RAM-backed).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, few saves (tests: only checks it runs).")
flags.DEFINE_float("step_ms", 15.0, "Time between a save and the next update (the rest of a "
                   "training step: the user's setup's steps take 15-18 ms); 0: the update at once.")


def _peak_rss_reset():
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass


def _status(field="VmHWM"):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  return 0


def _floors(nbytes, directory):
  """Medians of (memcpy, raw write+fsync, raw write CPU, CRC32C) seconds for `nbytes`."""
  from tfdp.checkpoint.format import checksum  # pylint: disable=g-import-not-at-top
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  copies, writes, cpus, crcs = [], [], [], []
  path = os.path.join(directory, "raw.bin")
  for _ in range(5):
    t = time.perf_counter()
    np.copyto(dst, src)
    copies.append(time.perf_counter() - t)
    t = time.perf_counter()
    checksum.value(dst)
    crcs.append(time.perf_counter() - t)
    t, c = time.perf_counter(), time.thread_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.writev(fd, [memoryview(src)])
    os.fsync(fd)
    os.close(fd)
    writes.append(time.perf_counter() - t)
    cpus.append(time.thread_time() - c)
    os.remove(path)
  return tuple(bench_common.median(x) for x in (copies, writes, cpus, crcs))


class _Position:
  """A per-worker data position: a checkpointable iterator of a shuffled pipeline, advanced each step."""

  def __init__(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.data import iterators  # pylint: disable=g-import-not-at-top
    ds = (tf.data.Dataset.range(10**9).map(lambda i: (tf.cast(i, tf.float32), i))
          .shuffle(FLAGS.shuffle, seed=1).batch(32))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])  # A tf.distribute iterator, as fit's.
    self.iterator = iter(iterators.checkpointable(ds, strategy))
    for _ in range(FLAGS.shuffle // 32 + 2):
      next(self.iterator)


def _measure(kind, mb, base):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  variables = [tf.Variable(tf.random.uniform([1 << 18], seed=i)) for i in range(mb)]
  step = tf.Variable(0, dtype=tf.int64)
  ckpt = tf.train.Checkpoint(vars=variables, step=step)
  position = _Position() if FLAGS.data_position else None
  work = tempfile.mkdtemp(prefix=f"save-{kind}-{mb}-", dir=base)
  local = tempfile.mkdtemp(prefix="local-", dir=FLAGS.local_root) if kind == "local" else None
  mgr = tfdp.CheckpointManager(
      ckpt, os.path.join(work, "ckpt"), max_to_keep=2, async_save=kind == "async",
      local_checkpoint_dir=local,
      per_worker={"data": position.iterator} if position else None)

  @tf.function
  def train_step():
    for v in variables:
      v.assign_add(tf.ones_like(v) * 1e-3)
    step.assign_add(1)

  blocked, other_cpu, after, plain = [], [], [], []
  state_bytes, rss0 = 0, None
  for i in range(FLAGS.saves + 2):
    if i == 2:  # After the warm-ups (first traces, the slots' mapping made).
      _peak_rss_reset()
      rss0 = _status()
    train_step()
    if position is not None:
      next(position.iterator)
    t = time.perf_counter()
    if kind == "local":
      mgr.save_local(int(step.numpy()))
    else:
      mgr.save(checkpoint_number=int(step.numpy()))
    took = time.perf_counter() - t
    time.sleep(FLAGS.step_ms / 1e3)  # The rest of the step, while the writer works.
    t = time.perf_counter()
    train_step()  # An update while the writer may still hold aliases (copy-on-write).
    in_flight = time.perf_counter() - t
    mgr.sync()
    t = time.perf_counter()
    train_step()  # The same update with no save in flight.
    alone = time.perf_counter() - t
    writer = (mgr._local._writer if kind == "local" else mgr._writer)  # pylint: disable=protected-access
    if i >= 2:
      blocked.append(took)
      other_cpu.append(writer.cpu_seconds[-1] if kind != "sync" else 0.0)
      after.append(in_flight)
      plain.append(alone)
  # The local tier's two slots are mapped (shared memory, counted in RSS) from
  # the first save on; the rest is what the saves added to the peak since.
  shmem = _status("RssShmem")
  peak = _status() - rss0 + shmem
  if kind == "local":
    from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
    state_bytes = manifest_lib.read_manifest(mgr.local_checkpoints()[-1]).state_bytes
  mgr.close()
  shutil.rmtree(work, ignore_errors=True)
  if local:
    shutil.rmtree(local, ignore_errors=True)
  return {"blocked_s": bench_common.median(blocked), "writer_cpu_s": bench_common.median(other_cpu),
          "next_update_extra_s": bench_common.median(after) - bench_common.median(plain),
          "peak_rss_delta": peak, "slots_bytes": shmem, "state_bytes": state_bytes}


def main(argv):
  del argv
  if FLAGS.smoke:
    FLAGS.mb, FLAGS.saves, FLAGS.shuffle = ["1"], 2, 256
  base = tempfile.mkdtemp(prefix="bench_save-", dir=FLAGS.dir)
  rows = []
  try:
    for mb in (int(m) for m in FLAGS.mb):
      for kind in FLAGS.kinds:
        r = _measure(kind, mb, base)
        nbytes = r["state_bytes"] or mb << 20  # The bytes the copy holds (the position's too).
        memcpy, write, write_cpu, crc = _floors(nbytes, base)
        row = {"kind": kind, "mb": mb, "bytes": nbytes, "memcpy_s": memcpy, "crc32c_s": crc,
               "raw_write_s": write, "raw_write_cpu_s": write_cpu, **r,
               "blocked_over_memcpy": r["blocked_s"] / memcpy,
               "writer_over_floor": r["writer_cpu_s"] / (memcpy + crc),
               "peak_over_state": r["peak_rss_delta"] / nbytes}
        rows.append(row)
        print(f"[bench_save] {kind:5s} {mb:4d} MB ({nbytes / 1e6:.1f} MB saved): blocked "
              f"{1e3 * r['blocked_s']:6.2f} ms ({row['blocked_over_memcpy']:4.2f}x memcpy "
              f"{1e3 * memcpy:.2f} ms), next update +{1e3 * r['next_update_extra_s']:.2f} ms, "
              f"writer CPU {1e3 * r['writer_cpu_s']:6.2f} ms ({row['writer_over_floor']:4.2f}x "
              f"memcpy+crc32c {1e3 * (memcpy + crc):.2f} ms; raw write CPU {1e3 * write_cpu:.2f}),"
              f" peak RSS +{r['peak_rss_delta'] / 1e6:.1f} MB ({row['peak_over_state']:.2f}x)",
              flush=True)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  result = {"machine": bench_common.machine(), "data_position": FLAGS.data_position,
            "shuffle": FLAGS.shuffle, "rows": rows}
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
