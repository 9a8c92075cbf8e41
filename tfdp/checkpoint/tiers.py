"""The local checkpoint tier: each worker's own copies in host memory, and the choice and recovery of the newest state."""

import dataclasses
import hashlib
import os
import tempfile
import time
import uuid

from absl import logging
import numpy as np
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import planner
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import storage

# Local checkpoints each worker keeps: the newest and the one before, so a
# crash during a local save leaves the previous one.
LOCAL_KEEP = 2
# RAM-backed where the host has it (Linux's tmpfs), else the temp dir.
DEFAULT_LOCAL_ROOT = "/dev/shm/tfdp-local"


def default_local_dir(directory: str) -> str:
  """The local tier of persistent `directory` when none is given: under /dev/shm, named by its path."""
  root = DEFAULT_LOCAL_ROOT if os.path.isdir("/dev/shm") else os.path.join(
      tempfile.gettempdir(), "tfdp-local")
  name = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:16]
  return os.path.join(root, name)


def ensure_token(layout: layout_lib.Layout) -> str:
  """The persistent directory's run token, made by the chief when the directory has none.

  Local checkpoints record it: when the persistent directory is emptied or
  replaced (a new run in the same place), it gets a new token and the local
  copies of the old run, which may still sit in host memory, are ignored.
  """
  found = fs.read_json(layout.tiers_path)
  if found is not None:
    return found["token"]
  token = uuid.uuid4().hex
  fs.write_json_atomic(layout.tiers_path, {"token": token, "time": time.time()})
  return token


def read_token(layout: layout_lib.Layout, timeout: float) -> str:
  """The run token the chief made (see ensure_token), waiting up to `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while True:
    found = fs.read_json(layout.tiers_path)
    if found is not None:
      return found["token"]
    if time.monotonic() > deadline:
      raise errors.CheckpointError(
          f"{layout.tiers_path} did not appear within {timeout:.0f}s: the chief "
          "did not start its checkpoint manager with the local tier. Every "
          "worker must pass the same local_checkpoint_every_steps.")
    time.sleep(0.05)


@dataclasses.dataclass(frozen=True)
class Held:
  """One intact local checkpoint of this worker."""
  step: int
  prefix: str
  manifest: manifest_lib.Manifest


class LocalTier:
  """One worker's local checkpoints: `<root>/worker-<index>/<name>-<step>`, each a whole checkpoint.

  Args:
    root: the local directory (per host; workers of one host get their own
      sub-directories).
    worker, num_workers: this worker in the job.
    name: the checkpoint name.
    every_steps: how often the training loop saves locally.
  """

  def __init__(self, root: str, worker: int, num_workers: int, name: str,
               every_steps: int | None):
    self.root = os.fspath(root).rstrip("/")
    self.worker = worker
    self.num_workers = num_workers
    self.every_steps = every_steps
    self.layout = layout_lib.Layout(os.path.join(self.root, f"worker-{worker}"), name)
    self.token = ""

  def start(self, token: str, session: str) -> None:
    """Makes the directory and removes what torn local saves left."""
    self.token = token
    fs.makedirs(self.layout.directory)
    storage.cleanup(self.layout, session)

  def held(self) -> list[Held]:
    """This worker's intact local checkpoints of this run, newest first.

    Sizes are checked against each manifest (TF checks every tensor's CRC32C
    when it reads); one of another run, another world size or with damaged
    files is deleted, with a warning.
    """
    out = []
    for prefix in reversed(self.layout.committed()):
      man = manifest_lib.read_manifest(prefix)
      problem = None
      if man is None or man.tier != "local":
        problem = "no local-tier manifest"
      elif man.run_token != self.token:
        problem = "of another run in this directory"
      elif man.world_size != self.num_workers:
        problem = f"saved by a job of {man.world_size} workers, this one has {self.num_workers}"
      else:
        try:
          restore_lib.check_sizes(prefix, man)
        except errors.CorruptCheckpointError as e:
          problem = str(e)
      if problem is not None:
        if man is None or man.run_token == self.token:
          logging.warning("tfdp: deleting local checkpoint %s: %s", prefix, problem)
        self.delete(prefix)
        continue
      out.append(Held(man.step, prefix, man))
    return out

  def delete(self, prefix: str) -> None:
    storage.delete(self.layout, prefix)

  def prune(self, keep: int = LOCAL_KEEP) -> None:
    """Deletes all but the newest `keep` local checkpoints."""
    committed = self.layout.committed()
    for prefix in committed[:max(0, len(committed) - keep)]:
      storage.delete(self.layout, prefix)

  def job(self, step: int, save_id: str, files, meta: manifest_lib.SaveMeta,
          timeout: float) -> storage.SaveJob:
    """The SaveJob of a local save at `step`: this worker alone writes and commits a whole checkpoint."""
    return storage.SaveJob(
        layout=self.layout, prefix=self.layout.prefix(step),
        tmp_dir=self.layout.tmp_dir(save_id, step), save_id=save_id, worker=0,
        num_workers=1, files=files, timeout=timeout, meta=meta,
        owner=self.worker, world_size=self.num_workers)


# -- choosing what to restore --

@dataclasses.dataclass(frozen=True)
class Choice:
  """What every worker restores: `kind` is "local", "peer" or "persistent"."""
  kind: str
  step: int | None = None
  holders: tuple[int, ...] = ()


def offer(held: list[Held], persistent_step: int | None) -> list[float]:
  """This worker's row of the agreement: [persistent step + 1, (step + 1, required) x LOCAL_KEEP]."""
  row = [0.0 if persistent_step is None else persistent_step + 1.0]
  for i in range(LOCAL_KEEP):
    if i < len(held):
      row += [held[i].step + 1.0, 1.0 if held[i].manifest.per_worker_required else 0.0]
    else:
      row += [0.0, 0.0]
  return row


def choose(table) -> Choice:
  """The newest state the workers can have, from every worker's `offer` row (pure).

  The newest step any worker holds locally wins when it is newer than the
  persistent tier's (or as new, and held by every worker): "local" when
  every worker holds it, "peer" when some do and the others can get it from
  them, which needs its per-worker state to be not required. Otherwise the
  next older local step is tried, and at last the persistent tier.
  """
  table = np.asarray(table, np.float64)
  persistent = int(table[:, 0].min()) - 1  # -1: none (0 on any worker).
  holders = {}
  required = {}
  for w, row in enumerate(table):
    for i in range(LOCAL_KEEP):
      step = int(row[1 + 2 * i]) - 1
      if step >= 0:
        holders.setdefault(step, []).append(w)
        required[step] = required.get(step, False) or bool(row[2 + 2 * i])
  for step in sorted(holders, reverse=True):
    if step < persistent:
      break
    who = tuple(sorted(holders[step]))
    if len(who) == len(table):
      return Choice("local", step, who)
    if step > persistent and not required[step]:
      return Choice("peer", step, who)
  return Choice("persistent")


# -- recovery from peers --

# Sent as they are; int32 is not: TF keeps int32 tensors in host memory,
# and a batch must be all on the host or all on the devices.
_DIRECT = (tf.float32, tf.float64, tf.int64)


def _neutral(dtype):
  # x + (-0.0) == x bit for bit for every float x, +0.0 and -0.0 included
  # (+0.0 would turn a -0.0 into +0.0).
  return tf.constant(-0.0 if dtype.is_floating else 0, dtype)


def _all_reduce_from(strategy, source_replica: int, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
  """Every worker gets `tensors` of replica `source_replica`: one SUM all-reduce each, the others adding a neutral 0."""
  if not tensors:
    return []

  @tf.function
  def run(values):
    def replica_fn(vals):
      ctx = tf.distribute.get_replica_context()
      take = tf.equal(ctx.replica_id_in_sync_group, source_replica)
      sent = [tf.where(take, v, _neutral(v.dtype)) for v in vals]
      out = [None] * len(sent)
      # One batch per dtype: TF packs a batch into one buffer.
      for dtype in sorted({v.dtype for v in sent}, key=lambda d: d.name):
        idx = [i for i, v in enumerate(sent) if v.dtype == dtype]
        for i, r in zip(idx, ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                            [sent[i] for i in idx])):
          out[i] = r
      return out

    out = strategy.run(replica_fn, args=(values,))
    return [strategy.experimental_local_results(o)[0] for o in out]

  return [tf.identity(t) for t in run(list(tensors))]


def _to_wire(t: tf.Tensor) -> tf.Tensor:
  """A form the all-reduce sums exactly: float32/64 and int64 as they are, int32 and bool as int64, other dtypes' bytes as int64."""
  if t.dtype in _DIRECT:
    return t
  if t.dtype in (tf.bool, tf.int32):
    return tf.cast(t, tf.int64)
  return tf.cast(tf.bitcast(t, tf.uint8), tf.int64)


def _from_wire(w: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
  if like.dtype in _DIRECT:
    return w
  if like.dtype in (tf.bool, tf.int32):
    return tf.cast(w, like.dtype)
  return tf.bitcast(tf.cast(w, tf.uint8), like.dtype)


def transfer(items: list[planner.Item], source: int, strategy) -> list[planner.Item]:
  """The values of `items` on worker `source`, on every worker (every worker must call it).

  Each tensor is one all-reduce in which only the source's first replica
  contributes; strings go as their serialized bytes, after one all-reduce
  of their lengths. Every worker passes Items with the same keys, shapes and
  dtypes (the same checkpoint structure); the object graph is not sent.

  Returns:
    `items` with the source's values.
  """
  local = len(strategy.extended.worker_devices)
  src = source * local
  numeric, values, strings, blobs = [], [], [], []
  for it in items:
    if it.key == planner.OBJECT_GRAPH_KEY:
      continue
    value = tf.convert_to_tensor(it.value)
    if value.dtype == tf.string:
      strings.append(it)
      blobs.append(tf.io.serialize_tensor(value).numpy())
    else:
      numeric.append(it)
      values.append(value)
  wires = [_to_wire(v) for v in values]
  wires.append(tf.constant([len(b) for b in blobs], tf.int64, shape=[len(blobs)]))
  got = _all_reduce_from(strategy, src, wires)
  lengths = got.pop().numpy()
  out = {id(it): tf.identity(_from_wire(w, v)) for it, w, v in zip(numeric, got, values)}
  if strings:
    padded = []
    for b, n in zip(blobs, lengths):
      buf = np.zeros(int(n), np.int64)
      raw = np.frombuffer(b, np.uint8)[:int(n)]
      buf[:len(raw)] = raw
      padded.append(tf.constant(buf))
    for it, w in zip(strings, _all_reduce_from(strategy, src, padded)):
      data = w.numpy().astype(np.uint8).tobytes()
      out[id(it)] = tf.io.parse_tensor(data, tf.string)
  return [dataclasses.replace(it, value=out[id(it)]) if id(it) in out else it
          for it in items]
