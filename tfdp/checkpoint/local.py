"""The local checkpoint tier: each worker's own whole copies in host memory, written in the background."""

import collections
import dataclasses
import json
import time
import uuid

from absl import logging

from tfdp import errors
from tfdp.checkpoint import async_writer
from tfdp.checkpoint import catalog
from tfdp.checkpoint import fs
from tfdp.checkpoint import items as items_lib
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import policy
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import storage

# Local checkpoints each worker keeps: the newest and the one before, so a
# crash during a local save leaves the previous one.
LOCAL_KEEP = 2


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


def make(layout: layout_lib.Layout, directory: str | None, every_steps: int | None, me,
         timeout: float) -> "LocalTier | None":
  """The local tier of the persistent `layout` for worker `me`, or None when not asked for.

  Raises:
    ConfigError: a negative cadence, or several workers without a strategy
      (they agree on the newest state through its collectives).
  """
  if directory is None and not every_steps:
    return None
  if every_steps is not None and every_steps < 0:
    raise errors.ConfigError(
        f"local_checkpoint_every_steps={every_steps}: pass a positive number of steps.")
  if me.count > 1 and me.strategy is None:
    raise errors.ConfigError(
        "The local checkpoint tier needs a MultiWorkerMirroredStrategy with "
        f"{me.count} workers: the workers agree on the newest state and "
        "recover lost copies through its collectives. Build the manager under "
        "strategy.scope() or pass strategy=.")
  return LocalTier(layout.local(directory, me.index), me.index, me.count, every_steps or None,
                   timeout)


@dataclasses.dataclass(frozen=True)
class Held:
  """One intact local checkpoint of this worker."""
  step: int
  prefix: str
  manifest: manifest_lib.Manifest


class LocalTier:
  """One worker's local checkpoints: `<root>/worker-<index>/<name>-<step>`, each a whole checkpoint.

  Saves run in a thread of their own (`save`); one while the previous is
  still being written is skipped, so training never waits for this tier.

  Args:
    layout: this worker's local layout (`Layout.local(root, worker)`).
    worker, num_workers: this worker in the job.
    every_steps: how often the training loop saves locally (None: when
      the caller says).
    timeout: seconds a save may wait (a local save waits for nobody).
  """

  def __init__(self, layout: layout_lib.Layout, worker: int, num_workers: int,
               every_steps: int | None, timeout: float):
    self.layout = layout
    self.worker = worker
    self.num_workers = num_workers
    self.every_steps = every_steps
    self.cadence = policy.Cadence(*((policy.EveryNSteps(every_steps),) if every_steps else ()))
    self.token = ""
    self.skipped = 0
    # (seconds the caller was blocked, the writer thread's CPU seconds) of
    # the latest saves, newest last: what a save costs, for the cadence.
    self.costs = collections.deque(maxlen=16)
    self._timeout = timeout
    self._session = ""
    self._writer = async_writer.AsyncWriter()
    self._record = None  # The manifest fields that stay the same from save to save.

  def start(self, token: str, session: str) -> None:
    """Makes the directory and removes what torn local saves left."""
    self.token, self._session = token, session
    fs.makedirs(self.layout.directory)
    storage.cleanup(self.layout, session, private=True)

  # -- saving --

  def busy(self) -> bool:
    """Whether a save is being written (a new one would be skipped)."""
    return self._writer.running()

  def save(self, step: int, take, meta: manifest_lib.SaveMeta) -> str | None:
    """Saves local checkpoint `step` of the Items `take()` returns, written in the background.

    Blocks only for `take()`: a snapshot (reads that alias the variables'
    buffers; TF copies a buffer before the next update writes it) and the
    variant of an iterator's position. The writer thread turns variants into
    bytes, writes one file and its index straight under the final name and
    commits them with a manifest: no temp dir, no merge.

    Returns:
      The prefix, or None when skipped because the previous save is still
      being written.
    """
    if self.busy():
      self.skipped += 1
      return None
    start = time.perf_counter()
    self.wait()
    prefix = self.layout.prefix(step)
    if fs.exists(layout_lib.manifest_path(prefix)):
      return prefix
    items = items_lib.snapshot(take())
    record = self._fields(meta, items)
    blocked = time.perf_counter() - start

    def write():
      cpu = time.thread_time()
      self._write(prefix, items, record)
      self.prune()
      self.costs.append((blocked, time.thread_time() - cpu))

    self._writer.submit(write)
    return prefix

  def write(self, step: int, items, meta: manifest_lib.SaveMeta) -> Held:
    """Writes local checkpoint `step` now (e.g. a copy received from a peer)."""
    prefix = self.layout.prefix(step)
    man = self._write(prefix, items, self._fields(meta, items))
    self.prune()
    return Held(step, prefix, manifest_lib.Manifest.from_json(json.dumps(man)))

  def _write(self, prefix, items, record):
    return storage.write_whole(prefix, items, record, self.worker)

  def _fields(self, meta, items):
    """The manifest fields of a save of `items` with `meta`; the static ones made once per key set."""
    keys = [it.key for it in items]
    if self._record is None or self._record["files"][0]["tensors"] != keys:
      self._record = {
          "files": [{"tensors": keys}], "world_size": self.num_workers,
          "writers": {str(self.worker): {"files": 1}}, "kept": [],
          "manifest_version": manifest_lib.MANIFEST_VERSION}
    return dict(self._record, session=self._session, **dataclasses.asdict(meta))

  def wait(self) -> None:
    """Waits for the background save; a failed one is logged (training goes on)."""
    try:
      self._writer.wait()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: a local checkpoint save failed (training goes on; the "
                      "persistent tier is not affected): %s", e)

  # -- what is held --

  def committed(self) -> list[str]:
    """Prefixes of this worker's committed local checkpoints, oldest first."""
    return catalog.committed(self.layout)

  def held(self) -> list[Held]:
    """This worker's intact local checkpoints of this run, newest first.

    Sizes are checked against each manifest (TF checks every tensor's CRC32C
    when it reads); one of another run, another world size or with damaged
    files is deleted, with a warning.
    """
    out = []
    for prefix in reversed(catalog.committed(self.layout)):
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
    committed = catalog.committed(self.layout)
    for prefix in committed[:max(0, len(committed) - keep)]:
      storage.delete(self.layout, prefix)

  def drop(self) -> None:
    """Deletes every local checkpoint (e.g. once training completed and the persistent tier has the end)."""
    self.wait()
    for prefix in catalog.committed(self.layout):
      self.delete(prefix)
