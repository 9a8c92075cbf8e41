"""The local checkpoint tier: each worker's own whole copies in host memory, written in the background."""

import collections
import dataclasses
import json
import os
import time
import uuid

from absl import logging

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import async_writer
from tfdp.checkpoint import catalog
from tfdp.checkpoint import fs
from tfdp.checkpoint import items as items_lib
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import peers
from tfdp.checkpoint import planner
from tfdp.checkpoint import policy
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import storage

# Local checkpoints each worker keeps: the newest and the one before, so a
# crash during a local save leaves the previous one.
LOCAL_KEEP = 2
# With local_checkpoint_every_steps="auto": the share of the training time
# local saves may cost (their blocked time and their writer's CPU), and how
# often (in steps) the workers measure and agree on the interval again.
DEFAULT_OVERHEAD = 0.02
AGREE_EVERY_STEPS = 25


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


def make(layout: layout_lib.Layout, directory: str | None, every_steps, me, timeout: float,
         overhead: float = DEFAULT_OVERHEAD) -> "LocalTier | None":
  """The local tier of the persistent `layout` for worker `me`, or None when not asked for.

  Args:
    layout: the persistent directory's layout.
    directory: the local root (None: the default, under /dev/shm).
    every_steps: an int, "auto" (as often as `overhead` allows), or None.
    me: this worker.
    timeout: seconds to wait for peers.
    overhead: with "auto", the share of the training time saves may cost.

  Raises:
    ConfigError: a bad cadence or overhead, or several workers without a
      strategy (they agree on the newest state through its collectives).
  """
  every_steps = policy.every_steps(every_steps)
  if directory is None and not every_steps:
    return None
  if me.count > 1 and me.strategy is None:
    raise errors.ConfigError(
        "The local checkpoint tier needs a MultiWorkerMirroredStrategy with "
        f"{me.count} workers: the workers agree on the newest state and "
        "recover lost copies through its collectives. Build the manager under "
        "strategy.scope() or pass strategy=.")
  return LocalTier(layout.local(directory, me.index), me, every_steps, timeout, overhead)


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
    me: this worker (`tfdp.cluster.Worker`).
    every_steps: how often the training loop saves locally: an int, "auto"
      (see `due`), or None (when the caller says).
    timeout: seconds a restore waits for its peers.
    overhead: with "auto", the share of the training time saves may cost.
  """

  def __init__(self, layout: layout_lib.Layout, me, every_steps, timeout: float,
               overhead: float = DEFAULT_OVERHEAD):
    self.layout = layout
    self.me = me
    self.worker = me.index
    self.num_workers = me.count
    self.every_steps = every_steps
    self._auto = policy.EveryAutoSteps(overhead) if every_steps == "auto" else None
    rule = self._auto or (policy.EveryNSteps(every_steps) if every_steps else None)
    self._cadence = policy.Cadence(*((rule,) if rule else ()))
    self._window = policy.Cadence(policy.EveryNSteps(AGREE_EVERY_STEPS))
    self._window_start = None  # (time, step, blocked so far) where the window began.
    self._blocked_total = 0.0
    self.token = ""
    self.skipped = 0
    # The seconds the caller was blocked in the latest saves (`costs`).
    self._blocked = collections.deque(maxlen=16)
    # step -> the files of this worker's committed local copy (manifest first).
    self._files = {}
    self._timeout = timeout
    self._session = ""
    self._writer = async_writer.AsyncWriter()
    self._record = None  # The manifest fields that stay the same from save to save.
    self.link = None  # The side channel to the other workers (tfdp.checkpoint.peers).

  def connect(self) -> None:
    """Opens the side channel (every worker at the same point: it agrees on the ports)."""
    if self.num_workers > 1:
      self.link = peers.PeerLink(
          self.me, peers.PeerCopies(self.layout.directory, self.layout.name, LOCAL_KEEP))
      self.link.spool = self._spool

  @property
  def interval(self) -> int | None:
    """The steps between local saves now (with "auto": the agreed one)."""
    return self._auto.interval if self._auto else self.every_steps

  def due(self, step: int) -> bool:
    """Whether the training loop saves locally after `step` (every worker calls it at every step).

    With "auto", every AGREE_EVERY_STEPS steps the workers measure what a
    save cost (its blocked time plus its writer's CPU, the median of the
    last ones) against the time a step took in the window, and agree (one
    small all-reduce, the largest proposal) on the smallest interval within
    the overhead budget; before the first window, every step.
    """
    if self._auto is not None:
      self._retune(step)
    return self._cadence.due(step)

  def _retune(self, step):
    now = time.perf_counter()
    if self._window_start is None:
      self._window.start(step)
      self._window_start = (now, step, self._blocked_total)
      return
    if not self._window.due(step):
      return
    t0, s0, blocked0 = self._window_start
    self._window_start = (now, step, self._blocked_total)
    costs = sorted(b + w for b, w in self.costs)
    cost = costs[len(costs) // 2] if costs else None
    step_seconds = max(0.0, now - t0 - (self._blocked_total - blocked0)) / max(1, step - s0)
    proposal = (self._auto.interval if cost is None
                else self._auto.interval_for(cost, step_seconds))
    if self.me.count > 1:
      proposal = int(cluster.agree(proposal, "max", self.me.strategy))
    if proposal != self._auto.interval:
      self._auto.interval = proposal
      if self.me.is_chief:
        logging.info("tfdp: local saves every %d step(s): a save costs %.1f ms (blocked plus "
                     "its writer's CPU), a step %.1f ms, the budget is %.0f%%.", proposal,
                     1e3 * (cost or 0.0), 1e3 * step_seconds, 100 * self._auto.budget)

  def start(self, token: str, session: str) -> None:
    """Makes the directory and removes what torn local saves left."""
    self.token, self._session = token, session
    fs.makedirs(self.layout.directory)
    storage.cleanup(self.layout, session, private=True)
    for prefix in catalog.committed(self.layout):
      self._files[layout_lib.number_of(prefix)] = [layout_lib.manifest_path(prefix)] + (
          catalog.files_of(self.layout, prefix))

  # -- saving --

  def busy(self) -> bool:
    """Whether a save is being written (a new one would be skipped)."""
    return self._writer.running()

  def save(self, step: int, take, meta) -> str | None:
    """Saves local checkpoint `step` of the Items `take()` returns, written in the background.

    Blocks only for `take()`: a snapshot (reads that alias the variables'
    buffers; TF copies a buffer before the next update writes it) and the
    variant of an iterator's position. The writer thread turns variants into
    bytes, writes one file and its index straight under the final name and
    commits them with a manifest: no temp dir, no merge.

    Args:
      step: the global step.
      take: `fn()` -> the Items to save.
      meta: `fn()` -> the save's SaveMeta, called after `take`.

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
    if step in self._files:
      return prefix
    items = items_lib.snapshot(take())
    meta = meta()  # After take(): what it took decides some fields.
    blocked = time.perf_counter() - start
    self._blocked_total += blocked

    def write():
      self._write(step, prefix, items, self._fields(meta, items))
      self.prune()
      if self.link is not None:
        self._replicate(step, items)

    self._writer.submit(write)
    self._blocked.append(blocked)
    return prefix

  @property
  def costs(self) -> list[tuple[float, float]]:
    """(seconds the caller was blocked, the writer thread's CPU seconds) of the latest saves."""
    return list(zip(self._blocked, self._writer.cpu_seconds))

  def _write(self, step, prefix, items, record):
    man = storage.write_whole(prefix, items, record, self.worker)
    self._committed(step, prefix, man)
    return man

  def _committed(self, step, prefix, man):
    folder = os.path.dirname(prefix)
    self._files[step] = [layout_lib.manifest_path(prefix)] + [
        os.path.join(folder, f["name"]) for f in man["files"]]

  def _replicate(self, step, items):
    """Sends this worker's per-worker state of the save at `step` to its neighbour."""
    root = layout_lib.per_worker_prefix(self.worker)
    own = {it.key[len(root):]: items_lib.writable(it.value) for it in items
           if it.key.startswith(root)}
    if own:
      self.link.replicate(step, own, token=self.token, world_size=self.num_workers)

  def kept_for_left(self) -> list[int]:
    """Steps of the per-worker states this worker keeps of its left neighbour (of this run)."""
    if self.link is None:
      return []
    out = []
    for step in self.link.copies.steps(self.link.left):
      found = self.link.copies.get(self.link.left, step)
      if found is not None and found[0].get("token") == self.token and (
          found[0].get("world_size") == self.num_workers):
        out.append(step)
    return out

  def files_of(self, prefix: str) -> list[str]:
    """The index and data files of local copy `prefix`."""
    return self._files.get(layout_lib.number_of(prefix), [])[1:]

  def _spool(self, header):
    """Where the files of a copy a peer sends are written as they arrive (the side channel asks)."""
    if header["kind"] != "copy":
      return None
    man = json.loads(header["manifest"])
    tmp = self.layout.received(header["step"])
    return [tmp + name[len(man["prefix"]):] for name in header["files"]]

  def receive(self, step: int, header: dict, paths, own: dict | None) -> Held:
    """Makes a copy a peer sent (its files, already written here, and manifest) this worker's of `step`.

    With `own` (this worker's per-worker tensors, kept by its neighbour), they
    are written as a second shard and merged in, as a save would have held them.
    """
    del paths  # Where `_spool` put them: under `self.layout.received(step)`.
    prefix = self.layout.prefix(step)
    man = json.loads(header["manifest"])
    tmp = self.layout.received(step)
    shards = [(tmp, [k for f in man["files"] for k in f.get("tensors") or ()])]
    if own:
      root = layout_lib.per_worker_prefix(self.worker)
      items = [planner.Item(root + k, "", v, items_lib.nbytes(v)) for k, v in sorted(own.items())]
      storage.write_shard(tmp + "-own", items)
      shards.append((tmp + "-own", [it.key for it in items]))
    record = dict(self._fields_from(man), per_worker_required=own is not None)
    written = storage.merge_whole(shards, prefix, record, self.worker)
    self._committed(step, prefix, written)
    for path in catalog.files_of(layout_lib.Layout(self.layout.directory, None), tmp):
      fs.remove(path)
    self.prune()
    return Held(step, prefix, manifest_lib.Manifest.from_json(json.dumps(written)))

  def _fields_from(self, man: dict) -> dict:
    """A peer's manifest, made this worker's (its writer, session, no files yet)."""
    drop = ("prefix", "time", "files", "num_shards", "total_bytes", "state_bytes", "format")
    return dict({k: v for k, v in man.items() if k not in drop}, session=self._session,
                writers={str(self.worker): {"files": 1}})

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
    return [self.layout.prefix(step) for step in sorted(self._files)]

  def held(self) -> list[Held]:
    """This worker's intact local checkpoints of this run, newest first.

    Sizes are checked against each manifest (TF checks every tensor's CRC32C
    when it reads); one of another run, another world size or with damaged
    files is deleted, with a warning.
    """
    out = []
    for prefix in reversed(self.committed()):
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
    """Deletes local copy `prefix`: its manifest first, so a crash leaves no committed half."""
    for path in self._files.pop(layout_lib.number_of(prefix), ()):
      try:
        os.remove(path)
      except OSError:
        pass

  def prune(self, keep: int = LOCAL_KEEP) -> None:
    """Deletes all but the newest `keep` local checkpoints."""
    for step in sorted(self._files)[:max(0, len(self._files) - keep)]:
      self.delete(self.layout.prefix(step))

  def drop(self) -> None:
    """Deletes every local checkpoint (e.g. once training completed and the persistent tier has the end)."""
    self.wait()
    for prefix in self.committed():
      self.delete(prefix)
    if self.link is not None:
      self.link.copies.drop()
