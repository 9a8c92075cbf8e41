"""How a save's bytes land: shards written and fsynced per worker, markers, the chief's merge and commit."""

from collections.abc import Callable
from concurrent import futures
import dataclasses
import errno
import os
import time

from absl import logging
import tensorflow as tf
from tensorflow.python.ops import gen_io_ops

from tfdp import errors
from tfdp.checkpoint.persistent import catalog
from tfdp.checkpoint.format import commit as commit_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.persistent import lease as lease_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import planner
from tfdp.checkpoint.format import verify as verify_lib


@dataclasses.dataclass(frozen=True)
class SaveJob:
  """Everything one worker needs to finish one save, foreground or background."""
  layout: layout_lib.Layout
  prefix: str  # Final prefix, e.g. /dir/ckpt-7.
  tmp_dir: str  # Shared by all workers of this save.
  save_id: str  # The session and this save's sequence number: same on every worker.
  session: str  # The job's session, which the directory's lease names.
  worker: int
  num_workers: int
  files: list[list[planner.Item]]  # This worker's part of the SavePlan.
  timeout: float
  meta: manifest_lib.SaveMeta  # Chief only: written into the manifest.
  kept: tuple[str, ...] = ()  # Basenames the manager keeps after this save.
  # The chief's check, just before the commit point, that it still holds
  # the directory's lease (tfdp.checkpoint.persistent.lease.Holder.check).
  fence: Callable[[], None] | None = None

  @property
  def is_chief(self) -> bool:
    return self.worker == 0


def run(job: SaveJob) -> manifest_lib.Manifest:
  """Writes this worker's shards, then commits (chief) or waits for the commit.

  A worker that fails before its shards are done removes what it wrote (a
  job of one writer its whole temp dir); the chief of several leaves a
  FAILED marker there for the others, removed with the temp dir by the next
  manager's cleanup.

  Returns:
    The committed checkpoint's manifest.

  Raises:
    CheckpointError: a worker did not finish, the chief failed, or the disk
      is full (naming the directory, the bytes needed and the bytes free).
  """
  written = False
  try:
    _write_marker(job, _write_shards(job))
    written = True
    return _commit(job) if job.is_chief else _wait_for_commit(job)
  except BaseException as e:
    full = _disk_full(job, e)
    if not written or job.num_workers == 1:
      _discard(job)  # After its marker, a worker's shards are the chief's to merge.
    if job.is_chief and job.num_workers > 1:
      try:
        fs.write_json_atomic(job.layout.failed_path(job.tmp_dir),
                             {"error": str(full or e), "time": time.time()})
      except Exception:  # pylint: disable=broad-except
        pass
    if full is not None:
      raise full from None
    raise


def _disk_full(job, e) -> errors.CheckpointError | None:
  """The one-line error of a save that ran out of space, or None for any other failure."""
  if not (isinstance(e, tf.errors.ResourceExhaustedError)
          or getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
          or "No space left on device" in str(e)):
    return None
  need = sum(it.nbytes for f in job.files for it in f)
  free = fs.free_bytes(job.layout.directory)
  return errors.CheckpointError(
      f"Checkpoint {job.prefix} not saved: {job.layout.directory} is full (this "
      f"worker's part needs {need / 1e6:.1f} MB, "
      + (f"{free / 1e6:.1f} MB are free" if free is not None else "free space unknown")
      + "). Free space or move the directory, then run the same command again; "
      "the checkpoints committed before are untouched.")


def _discard(job):
  """Removes what this worker wrote of a failed attempt (never anything committed)."""
  try:
    if job.num_workers == 1:
      if fs.exists(job.tmp_dir):
        fs.rmtree(job.tmp_dir)
      return
    for name in fs.listdir(job.tmp_dir):
      if job.layout.is_workers(name, job.worker):
        fs.remove(os.path.join(job.tmp_dir, name))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("tfdp: could not remove the files of a failed save in %s: %s",
                    job.tmp_dir, e)


def _write_file(job, j, items):
  """Writes and fsyncs one shard file (TF releases the GIL while it writes)."""
  shard_prefix = job.layout.shard_prefix(job.tmp_dir, job.worker, j)
  nbytes = write_shard(shard_prefix, items)
  data = layout_lib.data_filename(shard_prefix, 0, 1)
  index = layout_lib.index_path(shard_prefix)
  fs.restrict(data)  # 0600 before the merge renames it into the checkpoint's folder.
  fs.fsync_file(data)
  fs.fsync_file(index)
  return {
      "prefix": os.path.basename(shard_prefix),
      "data": verify_lib.describe_data_file(data, [it.key for it in items]).to_dict(),
      "index_size": fs.size(index),
      "num_tensors": len(items),
      "state_bytes": sum(nbytes),
      "per_worker_bytes": sum(n for it, n in zip(items, nbytes)
                              if it.key.startswith(layout_lib.PER_WORKER_ROOT + "/")),
  }


def _write_shards(job) -> list[dict]:
  """Writes and fsyncs this worker's shard files into the save's temp dir; returns their records."""
  fs.makedirs(job.tmp_dir)
  if len(job.files) <= 1:  # None when this worker got no tensor.
    shards = [_write_file(job, j, f) for j, f in enumerate(job.files)]
  else:
    with futures.ThreadPoolExecutor(
        min(len(job.files), planner.PARALLEL_FILES),
        thread_name_prefix="tfdp-ckpt-file") as pool:
      shards = list(pool.map(lambda a: _write_file(job, *a), enumerate(job.files)))
  fs.fsync_dir(job.tmp_dir)
  return shards


def _write_marker(job, shards: list[dict]) -> None:
  """Tells the chief this worker's shards are durable: its marker, written atomically."""
  fs.write_json_atomic(job.layout.marker_path(job.tmp_dir, job.worker), {
      "worker": job.worker, "num_workers": job.num_workers,
      "session": job.save_id, "shards": shards, "time": time.time(),
      "bytes_written": sum(s["data"]["size"] + s["index_size"] for s in shards),
      "per_worker_bytes": sum(s["per_worker_bytes"] for s in shards)})


def write_shard(prefix: str, items: list[planner.Item]) -> list[int]:
  """Writes Items as one TF bundle under `prefix` (an index, one data file); returns each one's bytes.

  Variants (an iterator's position) become bytes here. Not fsynced: `seal`
  (or the caller) does.
  """
  with tf.device("/cpu:0"):
    values = [items_lib.writable(it.value) for it in items]
    gen_io_ops.save_v2(prefix, [it.key for it in items], [it.slice_spec for it in items],
                       values)
  return [items_lib.nbytes(v) for v in values]


def merge(prefixes: list[str], prefix: str) -> None:
  """Merges written bundles into one checkpoint `prefix`: their data files, in order, become its."""
  with tf.device("/cpu:0"):
    gen_io_ops.merge_v2_checkpoints(prefixes, prefix, delete_old_dirs=False)


def seal(prefix: str, keys_per_file: list[list[str]],
         sizes: list[int] | None = None) -> list[manifest_lib.FileRecord]:
  """Makes checkpoint `prefix`'s files durable and describes them for its manifest.

  Args:
    prefix: a checkpoint whose index and data files are written.
    keys_per_file: the tensors of each data file, in order.
    sizes: the bytes each data file must have (what its writer wrote), or None.

  Returns:
    The index's record (its CRC-32), then one per data file.

  Raises:
    CheckpointError: a data file has not the size its writer wrote.
  """
  n = len(keys_per_file)
  files = []
  for k, keys in enumerate(keys_per_file):
    path = layout_lib.data_filename(prefix, k, n)
    size = fs.size(path)
    if sizes is not None and size != sizes[k]:
      raise errors.CheckpointError(
          f"{path}: {size} bytes after merge, worker wrote {sizes[k]}; the file system "
          "lost data.")
    fs.restrict(path)
    fs.fsync_file(path)
    files.append(manifest_lib.FileRecord(os.path.basename(path), size, tensors=list(keys)))
  index = layout_lib.index_path(prefix)
  fs.restrict(index)
  fs.fsync_file(index)
  files.insert(0, verify_lib.describe_file(index))
  fs.fsync_dir(os.path.dirname(prefix))
  return files


def _poll(deadline_s, check, on_timeout):
  deadline = time.monotonic() + deadline_s
  pause = 0.01
  while True:
    result = check()
    if result is not None:
      return result
    if time.monotonic() > deadline:
      raise on_timeout()
    time.sleep(pause)
    pause = min(pause * 1.5, 0.5)


def _wait_for_markers(job):
  markers = {}

  def check():
    for w in range(job.num_workers):
      if w not in markers:
        m = fs.read_json(job.layout.marker_path(job.tmp_dir, w))
        if m is not None:
          markers[w] = m
    if len(markers) == job.num_workers:
      return [markers[w] for w in range(job.num_workers)]
    return None

  def timeout():
    missing = [w for w in range(job.num_workers) if w not in markers]
    return errors.CheckpointError(
        f"Checkpoint {job.prefix} not committed: worker(s) {missing} did "
        f"not finish writing their shards within {job.timeout:.0f}s (no "
        f"{job.layout.marker_path(job.tmp_dir, missing[0])}). The worker "
        "probably crashed or is stuck; checkpoints committed before it are untouched. "
        "Restart the job, or raise commit_timeout if the file system is slow.")

  return _poll(job.timeout, check, timeout)


def _commit(job):
  markers = _wait_for_markers(job)
  # Leftovers of an earlier failed attempt at the same number, or a
  # checkpoint a restore could not read and this save replaces (its
  # manifest first: never a manifest of other files).
  commit_lib.delete(job.layout, job.prefix)
  records = [s for m in markers for s in m["shards"]]
  merge([os.path.join(job.tmp_dir, s["prefix"]) for s in records], job.prefix)
  files = seal(job.prefix, [s["data"]["tensors"] for s in records],
               [s["data"]["size"] for s in records])
  man = manifest_lib.Manifest(
      **dataclasses.asdict(job.meta),
      prefix=os.path.basename(job.prefix), time=time.time(), files=files,
      num_shards=len(records), total_bytes=sum(f.size for f in files),
      state_bytes=sum(s["state_bytes"] for s in records),
      world_size=job.num_workers, session=job.save_id, kept=list(job.kept),
      writers={str(m["worker"]): {"bytes_written": m["bytes_written"],
                                  "files": len(m["shards"]),
                                  "per_worker_bytes": m.get("per_worker_bytes", 0)}
               for m in markers})
  commit_lib.commit(job.prefix, man, job.fence)
  try:
    fs.rmtree(job.tmp_dir)
  except tf.errors.OpError as e:
    logging.warning("tfdp: could not remove %s: %s", job.tmp_dir, e)
  return man


# A worker waiting for the chief's commit gives up once the directory's lease
# has not named its job for this long: the chief's commit (fenced by the
# lease) can no longer come. Longer than a chief's gap between releasing the
# lease (close()) and taking it again (a save after close()).
LEASE_GONE_S = 20.0


_REMOVED_BY = ("Something else removed it (another job, a script, or a callback that "
               "deleted its backup at the end of training).")


def _wait_for_commit(job):
  not_ours_since = None  # When the lease was first seen not naming this job.

  def check():
    nonlocal not_ours_since
    m = manifest_lib.read_manifest(job.prefix)
    if m is not None and m.session == job.save_id:
      return m
    failed = fs.read_json(job.layout.failed_path(job.tmp_dir))
    if failed is not None:
      raise errors.CheckpointError(
          f"Checkpoint {job.prefix} not committed: the chief failed: {failed['error']}")
    # No commit can come: waiting out the timeout would only hide that.
    if not fs.isdir(job.layout.directory):
      raise errors.CheckpointError(
          f"Checkpoint {job.prefix} not committed: {job.layout.directory} was "
          f"deleted while this worker waited for the chief's commit. {_REMOVED_BY}")
    # Deleted while this worker wrote its shards, the directory exists again
    # (this worker's own writes made it), without the lease.
    held = lease_lib.read(job.layout.lease_path)
    if held is not None and held.session == job.session:
      not_ours_since = None
    elif not_ours_since is None:
      not_ours_since = time.monotonic()
    elif time.monotonic() - not_ours_since > LEASE_GONE_S:
      raise errors.CheckpointError(
          f"Checkpoint {job.prefix} not committed: the lease of {job.layout.directory} "
          f"has not named this job (session {job.session}) for {LEASE_GONE_S:.0f}s "
          "while this worker waited for the chief's commit: the directory was deleted "
          f"(and written again), or another job took it over. {_REMOVED_BY}")
    return None

  def timeout():
    return errors.CheckpointError(
        f"Checkpoint {job.prefix} not committed: worker 0 (the chief) did not "
        f"write {layout_lib.manifest_path(job.prefix)} within "
        f"{2 * job.timeout:.0f}s. The chief crashed or hung, or it did not save "
        "at this step: every worker must call save() at the same steps. "
        "Checkpoints committed before it are untouched.")

  return _poll(2 * job.timeout, check, timeout)


def after_commit(layout: layout_lib.Layout, cat: catalog.Catalog, man: manifest_lib.Manifest,
                 prefix: str, sweep, chief: bool) -> None:
  """Records committed `prefix` in the catalog; the chief applies the retention decided before the save.

  TF's state file first, then the deletions (a crash between them leaves
  checkpoints that the next manager's retention deletes).
  """
  cat.commit(man, prefix, sweep)
  if chief:
    catalog.write_state(layout, cat)
    for e in sweep.deleted:
      commit_lib.delete(layout, e.prefix)


def remove_directory(layout: layout_lib.Layout) -> None:
  """Deletes the checkpoint directory and everything in it (nothing when it is gone)."""
  if fs.exists(layout.directory):
    fs.rmtree(layout.directory)
