"""Sharded checkpoint writes: split state by bytes, write per worker, merge and commit."""

from concurrent import futures
import dataclasses
import os
import re
import signal
import time

from absl import logging
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_io_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.training.saving import saveable_object

from tfdp import errors
from tfdp.checkpoint import manifest as manifest_lib

OBJECT_GRAPH_KEY = trackable_base.OBJECT_GRAPH_PROTO_KEY
# Root of the keys of per-worker state: `_tfdp_per_worker/<worker>/<key>`.
PER_WORKER_ROOT = "_tfdp_per_worker"
TMP_DIRNAME = ".tfdp-tmp"
# Test-only: "phase:worker[,phase:worker...]" makes that worker SIGKILL itself
# when its save reaches that phase (see PHASES).
CRASH_ENV = "TFDP_CKPT_TEST_CRASH_AT"
PHASES = ("before_shard", "after_shard", "after_marker", "during_commit",
          "after_commit")


def maybe_crash(phase, worker):
  """Kills this process with SIGKILL if CRASH_ENV asks for it at `phase`."""
  spec = os.environ.get(CRASH_ENV, "")
  for item in filter(None, spec.split(",")):
    want, _, who = item.partition(":")
    if want == phase and (who == "" or int(who) == worker):
      logging.warning("tfdp: %s=%s: killing worker %d at %s.", CRASH_ENV,
                      spec, worker, phase)
      os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass
class Item:
  """One tensor (or slice) of the state as it will be written."""
  key: str
  slice_spec: str
  value: object  # tf.Tensor, or np.ndarray once snapshotted.
  nbytes: int


def _nbytes(t):
  if t.dtype == tf.string:
    return int(sum(len(b) for b in np.ravel(t.numpy()))) + 8 * max(
        1, int(np.prod(t.shape)))
  return int(np.prod(t.shape, dtype=np.int64)) * t.dtype.size


def gather(checkpoint, key_prefix="", with_object_graph=True):
  """Returns the Items of `checkpoint` (a tf.train.Checkpoint), without copying.

  Uses the same serialization as `tf.train.Checkpoint.write` (object graph
  proto under `_CHECKPOINTABLE_OBJECT_GRAPH`), so the merged result is a
  checkpoint plain TF restores.
  """
  serialized, _, registered, _ = (
      checkpoint._saver._gather_serialized_tensors(None))  # pylint: disable=protected-access
  if registered:
    raise errors.CheckpointError(
        f"Objects with registered savers ({sorted(registered)}) are not "
        "supported by tfdp.CheckpointManager; save them with tf.train.Checkpoint.")
  items = []
  for tensor_dict in serialized.values():
    for key, slices in tensor_dict.items():
      if key == OBJECT_GRAPH_KEY and not with_object_graph:
        continue
      if not isinstance(slices, dict):
        slices = {"": slices}
      for slice_spec, value in slices.items():
        if isinstance(value, saveable_object.SaveSpec):
          device = value.device
          with tf.device(device if isinstance(device, str) and device else None):
            value = value.tensor
        if value is None:
          continue
        if callable(value) and not isinstance(value, tf.Tensor):
          value = value()
        value = tf.convert_to_tensor(value)
        items.append(Item(key_prefix + key, slice_spec, value, _nbytes(value)))
  items.sort(key=lambda it: (it.key, it.slice_spec))
  return items


def per_worker_prefix(worker):
  return f"{PER_WORKER_ROOT}/{worker}/"


def assign_workers(items, num_workers):
  """Balances Items over workers by bytes (largest first onto the lightest).

  Deterministic given the same items, so every worker computes the same
  plan without talking to the others. The object graph goes to worker 0.

  Returns:
    A list of `num_workers` lists of Items.
  """
  plan = [[] for _ in range(num_workers)]
  load = [0] * num_workers
  for it in sorted(items, key=lambda it: (-it.nbytes, it.key, it.slice_spec)):
    w = 0 if it.key == OBJECT_GRAPH_KEY else min(
        range(num_workers), key=lambda i: (load[i], i))
    plan[w].append(it)
    load[w] += it.nbytes
  for p in plan:
    p.sort(key=lambda it: (it.key, it.slice_spec))
  return plan


def split_files(items, max_bytes):
  """Splits one worker's Items into files of at most `max_bytes` (a bigger tensor gets its own)."""
  if not items:
    return []
  if not max_bytes:
    return [list(items)]
  files, cur, size = [], [], 0
  for it in items:
    if cur and size + it.nbytes > max_bytes:
      files.append(cur)
      cur, size = [], 0
    cur.append(it)
    size += it.nbytes
  files.append(cur)
  return files


# A worker writes its part as up to this many files at once when each gets at
# least PARALLEL_MIN_FILE_BYTES: TF's BundleWriter copies and checksums on one
# core (~1.4 GB/s here, half of what the page cache takes), so parallel files
# keep the disk, not one core, the limit.
PARALLEL_FILES = min(4, os.cpu_count() or 1)
PARALLEL_MIN_FILE_BYTES = 64 << 20


def split_for_parallel_write(items):
  """Splits one worker's Items into files of about equal bytes to write at once."""
  total = sum(it.nbytes for it in items)
  n = max(1, min(PARALLEL_FILES, total // PARALLEL_MIN_FILE_BYTES, len(items)))
  return [f for f in assign_workers(items, n) if f]


def snapshot(items):
  """Snapshots the values of `items` in host memory so later updates don't leak in.

  A tensor already in host memory is kept as is: it is the result of a
  ReadVariableOp, and TF's update kernels (assign*, every optimizer apply)
  copy a variable's buffer before writing when a reader still holds it
  (copy-on-write), so it cannot change. Other tensors (GPU/TPU) are copied
  to host memory.
  """
  out = []
  for it in items:
    value = it.value
    if isinstance(value, tf.Tensor) and "CPU" in (value.device or "").upper():
      out.append(it)
      continue
    value = value.numpy() if isinstance(value, tf.Tensor) else value
    out.append(dataclasses.replace(it, value=np.array(value, copy=True)))
  return out


def data_filename(prefix, shard, num_shards):
  return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


@dataclasses.dataclass
class SaveJob:
  """Everything one worker needs to finish one save, foreground or background."""
  directory: str
  prefix: str  # Final prefix, e.g. /dir/ckpt-7.
  tmp_dir: str  # Shared by all workers of this save.
  session: str
  worker: int
  num_workers: int
  files: list  # This worker's Items, split into files.
  timeout: float
  manifest_extra: dict  # Chief only: step, metrics, world size, versions...
  plan_kept: object = None  # Chief only: fn(new_entry) -> kept prefixes.
  on_commit: object = None  # fn(manifest) run on every worker after commit.

  @property
  def is_chief(self):
    return self.worker == 0

  def marker_path(self, worker):
    return os.path.join(self.tmp_dir, f"w{worker:05d}.done.json")

  @property
  def failed_path(self):
    return os.path.join(self.tmp_dir, "FAILED.json")

  def run(self):
    try:
      self._write_shards()
      if self.is_chief:
        manifest = self._commit()
      else:
        manifest = self._wait_for_commit()
    except BaseException as e:
      if self.is_chief:
        try:
          manifest_lib.write_json_atomic(
              self.failed_path, {"error": str(e), "time": time.time()})
        except Exception:  # pylint: disable=broad-except
          pass
      raise
    if self.on_commit is not None:
      self.on_commit(manifest)
    return manifest

  def _write_file(self, j, items):
    """Writes and fsyncs one shard file (TF releases the GIL while it writes)."""
    shard_prefix = os.path.join(self.tmp_dir, f"w{self.worker:05d}-{j:05d}")
    with tf.device("/cpu:0"):
      gen_io_ops.save_v2(
          shard_prefix, [it.key for it in items],
          [it.slice_spec for it in items],
          [tf.convert_to_tensor(it.value) for it in items])
    data = data_filename(shard_prefix, 0, 1)
    manifest_lib.fsync_file(data)
    manifest_lib.fsync_file(shard_prefix + ".index")
    return {
        "prefix": os.path.basename(shard_prefix),
        "data": manifest_lib.describe_data_file(data, [it.key for it in items]),
        "index_size": tf.io.gfile.stat(shard_prefix + ".index").length,
        "num_tensors": len(items),
        "state_bytes": sum(it.nbytes for it in items),
    }

  def _write_shards(self):
    maybe_crash("before_shard", self.worker)
    tf.io.gfile.makedirs(self.tmp_dir)
    if len(self.files) <= 1:  # None when this worker got no tensor.
      shards = [self._write_file(j, f) for j, f in enumerate(self.files)]
    else:
      with futures.ThreadPoolExecutor(
          min(len(self.files), PARALLEL_FILES),
          thread_name_prefix="tfdp-ckpt-file") as pool:
        shards = list(pool.map(self._write_file, range(len(self.files)),
                               self.files))
    manifest_lib.fsync_dir(self.tmp_dir)
    maybe_crash("after_shard", self.worker)
    manifest_lib.write_json_atomic(self.marker_path(self.worker), {
        "worker": self.worker, "num_workers": self.num_workers,
        "session": self.session, "shards": shards, "time": time.time(),
        "bytes_written": sum(s["data"]["size"] + s["index_size"]
                             for s in shards)})
    maybe_crash("after_marker", self.worker)

  def _wait_for_markers(self):
    deadline = time.monotonic() + self.timeout
    markers, pause = {}, 0.01
    while True:
      for w in range(self.num_workers):
        if w not in markers:
          m = manifest_lib.read_json(self.marker_path(w))
          if m is not None:
            markers[w] = m
      missing = [w for w in range(self.num_workers) if w not in markers]
      if not missing:
        return [markers[w] for w in range(self.num_workers)]
      if time.monotonic() > deadline:
        raise errors.CheckpointError(
            f"Checkpoint {self.prefix} not committed: worker(s) {missing} did "
            f"not finish writing their shards within {self.timeout:.0f}s (no "
            f"{self.marker_path(missing[0])}). The worker probably crashed or "
            "is stuck; the previous checkpoint is intact. Restart the job, or "
            "raise commit_timeout if the file system is slow.")
      time.sleep(pause)
      pause = min(pause * 1.5, 0.5)

  def _commit(self):
    markers = self._wait_for_markers()
    # Leftovers of an earlier failed attempt at the same number.
    for path in tf.io.gfile.glob(self.prefix + ".*"):
      tf.io.gfile.remove(path)
    shard_prefixes, records = [], []
    for m in markers:
      for s in m["shards"]:
        shard_prefixes.append(os.path.join(self.tmp_dir, s["prefix"]))
        records.append(s)
    n = len(shard_prefixes)
    with tf.device("/cpu:0"):
      gen_io_ops.merge_v2_checkpoints(shard_prefixes, self.prefix,
                                      delete_old_dirs=False)
    maybe_crash("during_commit", self.worker)
    files = []
    for k, s in enumerate(records):
      path = data_filename(self.prefix, k, n)
      size = tf.io.gfile.stat(path).length
      if size != s["data"]["size"]:
        raise errors.CheckpointError(
            f"{path}: {size} bytes after merge, worker wrote "
            f"{s['data']['size']}; the file system lost data.")
      manifest_lib.fsync_file(path)
      files.append(dict(s["data"], name=os.path.basename(path)))
    index = self.prefix + ".index"
    manifest_lib.fsync_file(index)
    files.insert(0, manifest_lib.describe_file(index))
    manifest_lib.fsync_dir(self.directory)
    now = time.time()
    manifest = dict(self.manifest_extra)
    manifest.update({
        "format": "tfdp-checkpoint",
        "manifest_version": manifest_lib.MANIFEST_VERSION,
        "prefix": os.path.basename(self.prefix),
        "checksum": manifest_lib.CHECKSUM,
        "files": files,
        "num_shards": n,
        "total_bytes": sum(f["size"] for f in files),
        "state_bytes": sum(s["state_bytes"] for s in records),
        "world_size": self.num_workers,
        "session": self.session,
        "time": now,
        "writers": {str(m["worker"]): {"bytes_written": m["bytes_written"],
                                       "files": len(m["shards"])}
                    for m in markers},
    })
    if self.plan_kept is not None:
      manifest["kept"] = sorted(self.plan_kept(manifest))
    # The commit point: the checkpoint exists once its manifest does.
    manifest_lib.write_json_atomic(manifest_lib.manifest_path(self.prefix),
                                   manifest)
    maybe_crash("after_commit", self.worker)
    try:
      tf.io.gfile.rmtree(self.tmp_dir)
    except tf.errors.OpError as e:
      logging.warning("tfdp: could not remove %s: %s", self.tmp_dir, e)
    return manifest

  def _wait_for_commit(self):
    path = manifest_lib.manifest_path(self.prefix)
    deadline = time.monotonic() + 2 * self.timeout
    pause = 0.01
    while True:
      m = manifest_lib.read_json(path)
      if m is not None and m.get("session") == self.session:
        return m
      failed = manifest_lib.read_json(self.failed_path)
      if failed is not None:
        raise errors.CheckpointError(
            f"Checkpoint {self.prefix} not committed: the chief failed: "
            f"{failed['error']}")
      if time.monotonic() > deadline:
        raise errors.CheckpointError(
            f"Checkpoint {self.prefix} not committed: worker 0 (the chief) "
            f"did not write {path} within {2 * self.timeout:.0f}s; it "
            "probably crashed. The previous checkpoint is intact.")
      time.sleep(pause)
      pause = min(pause * 1.5, 0.5)


_UNCOMMITTED_RE = r"^{name}-(\d+)\.(index|data-\d+-of-\d+|manifest\.json\.tmp-\d+)$"


def cleanup(directory, name, protected=(), session=None):
  """Deletes leftovers of torn saves: temp dirs and files of uncommitted checkpoints.

  Args:
    directory: the checkpoint directory.
    name: the checkpoint name (files are `<name>-<number>.*`).
    protected: prefixes (basenames) never deleted, e.g. those listed in TF's
      `checkpoint` state file by a non-tfdp writer.
    session: temp dirs of this session are in use and kept.
  """
  tmp = os.path.join(directory, TMP_DIRNAME)
  if tf.io.gfile.isdir(tmp):
    for sub in tf.io.gfile.listdir(tmp):
      sub = sub.rstrip("/")
      if session is not None and sub.startswith(session + "-"):
        continue
      logging.info("tfdp: removing %s (left by a save that did not commit)",
                   sub)
      tf.io.gfile.rmtree(os.path.join(tmp, sub))
  pattern = re.compile(_UNCOMMITTED_RE.format(name=re.escape(name)))
  try:
    names = tf.io.gfile.listdir(directory)
  except tf.errors.NotFoundError:
    return
  present = set(names)
  for fname in names:
    m = pattern.match(fname.rstrip("/"))
    if not m:
      continue
    base = f"{name}-{m.group(1)}"
    if fname.startswith(base + manifest_lib.MANIFEST_SUFFIX + ".tmp") or (
        base + manifest_lib.MANIFEST_SUFFIX not in present and
        base not in protected):
      logging.info("tfdp: removing %s (left by a save that did not commit)",
                   fname)
      tf.io.gfile.remove(os.path.join(directory, fname))
