"""The local checkpoint tier: each worker's own whole copies in host memory, written in the background."""

import dataclasses
import os
import threading
import time

from absl import logging

from tfdp.distribute import cluster
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.format import commit as commit_lib
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.local import generations
from tfdp.checkpoint.local import held_copies
from tfdp.checkpoint.local import phases as phases_lib
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.local import peers
from tfdp.checkpoint.format import planner
from tfdp.checkpoint.local import replicas as replicas_lib
from tfdp.checkpoint.local import save_queue
from tfdp.checkpoint.local import slot_choice
from tfdp.checkpoint.local import slots as slots_lib
from tfdp.checkpoint.local import wire

LOCAL_KEEP = generations.LOCAL_KEEP
Held = held_copies.Held  # One intact local copy (tfdp.checkpoint.recovery offers them).


class LocalTier:
  """One worker's local copies: two slot files in `<root>/worker-<index>/`, each copy committed by its record.

  Saves run in a thread of their own (`save`); one while the previous is
  still being written waits for it (the newest one only), so training never
  waits for this tier. A save fills a slot tfdp.checkpoint.local.slot_choice
  names: never the newest copy's, never the newest step complete on every
  worker (`generations.Generations`), waiting for one to be free. A
  neighbour's per-worker states are files (tfdp.checkpoint.local.replicas).

  Args:
    layout: this worker's local layout (`Layout.local(root, worker)`).
    me: this worker (`tfdp.distribute.cluster.Worker`).
    every_steps: how often the training loop saves locally: an int, "auto"
      (see `due`), or None (when the caller says).
    timeout: seconds a restore waits for its peers.
    overhead: with "auto", the share of the training time saves may cost.
  """

  def __init__(self, layout: layout_lib.Layout, me, every_steps, timeout: float,
               overhead: float = policy.DEFAULT_OVERHEAD):
    self.layout = layout
    self.me = me
    self.worker = me.index
    self.num_workers = me.count
    self.every_steps = every_steps
    self.cadence = policy.LocalCadence(every_steps, overhead, me, lambda: self.costs)
    self.token = ""
    # step -> manifest of this worker's committed copies; the writer thread,
    # the side channel's and the caller's use it under `_lock`.
    self._copies = {}
    self.slots = [slots_lib.Slot(layout.slot(k)) for k in range(slots_lib.COUNT)]
    self._mirrors = items_lib.HostMirrors()  # Device tensors' host copies, reused.
    self._sequence = 0
    self._lock = threading.RLock()
    self.generations = generations.Generations(me.count)
    self.replicas = replicas_lib.Replicas(layout.directory, layout.name)
    self._timeout = timeout
    self._session = ""
    self._queue = save_queue.SaveQueue(self._write)
    self._keep = None  # The step a restore falls back to if a transfer fails (`receiving`).
    self.link = None  # The side channel to the other workers (tfdp.checkpoint.local.peers).
    self.phases = phases_lib.PhaseTimes()  # Seconds of its restores' phases (scripts/bench_tiers.py).

  def connect(self) -> None:
    """Opens the side channel (every worker at the same point: two small agreements).

    The chief draws the job's secret and every worker gets it over the
    collectives (tfdp.distribute.cluster.shared_secret); then every worker's port.
    """
    if self.num_workers == 1:
      return
    self.link = self.make_link(cluster.shared_secret(self.me))
    ports = cluster.gather([self.link.port], self.me.strategy)[:, 0]
    self.link.start([(peers.own_host(a), int(p)) for a, p in zip(self.me.addresses, ports)])

  def make_link(self, secret: bytes) -> peers.PeerLink:
    """This worker's side channel on the job's `secret`: bound, not serving until its `start`."""
    return peers.PeerLink(self.me, secret, self.layout.directory, on_replica=self._keep_replica,
                          on_done=self.generations.done, incoming=self._incoming,
                          own_step=lambda: max(list(self._copies), default=None))

  @property
  def interval(self) -> int | None:
    """The steps between local saves now (with "auto": the agreed one)."""
    return self.cadence.interval

  def due(self, step: int) -> bool:
    """Whether the training loop saves locally after `step` (every worker calls it at every step)."""
    return self.cadence.due(step)

  def start(self, token: str, session: str) -> None:
    """Makes the directory and removes what torn saves and cut-short transfers left."""
    self.token, self._session = token, session
    fs.make_private_dir(self.layout.directory)
    commit_lib.cleanup(self.layout, session, private=True)
    self.replicas.cleanup()
    kept, sequence = held_copies.scan(self.layout)
    with self._lock:
      self._copies = kept
      self._sequence = max(self._sequence, sequence)
    if self.num_workers == 1:
      self.replicas.drop()  # Of an earlier job of several workers.

  @property
  def skipped(self) -> int:
    """Local saves never written: replaced while waiting, or no slot they may fill."""
    return self._queue.skipped

  def busy(self) -> bool:
    """Whether a save is being written (a new one would wait for it)."""
    return self._queue.busy()

  def save(self, step: int, take, meta) -> str:
    """Saves local copy `step` of the Items `take()` returns, written in the background.

    Blocks for `take()`: a snapshot (reads that alias the variables'
    buffers; TF copies a buffer before the next update writes it) and the
    variant of an iterator's position. The writer thread writes and commits
    the copy (tfdp.checkpoint.local.copies), sends the per-worker state to the
    neighbour, reports the step done, and lets go what `generations` says.
    With several workers, a save while the previous one is being written
    waits for it (the caller is blocked; counted in the cadence's blocked
    time, so "auto" saves less often): every worker writes every save due,
    so each step is complete everywhere one save after it was due (skipping
    instead, each worker would skip others, and such steps would be rare).
    With one worker, it waits in the queue (tfdp.checkpoint.local.save_queue)
    in place of any save waiting there. A copy of the same step already held
    (an earlier attempt's) is replaced.

    Args:
      step: the global step.
      take: `fn()` -> the Items to save.
      meta: `fn()` -> the save's SaveMeta, called after `take`.

    Returns:
      The prefix.
    """
    start = time.perf_counter()
    prefix = self.layout.prefix(step)
    items = items_lib.snapshot(take(), self._mirrors)
    job = (step, prefix, items, meta())  # meta after take(): what it took decides some fields.
    if self.num_workers > 1 and self.busy():
      self.wait()  # Keeping up (see above): a failed save before this one is logged here.
    self.cadence.note_blocked(time.perf_counter() - start)
    self._queue.put(job)
    return prefix

  def _write(self, step, prefix, items, meta):
    with self._lock:
      stale = step in self._copies
    if stale:  # An earlier attempt's copy of this number never stands in for this save.
      self.delete(prefix)
    k = self._free_slot()
    if k is None:
      self._queue.skip()
      return
    root = layout_lib.per_worker_prefix(self.worker)
    own = [it for it in items if it.key.startswith(root)]
    sequence = self._next_sequence()
    man = copies.write(self.slots[k], prefix, items, self._base(meta), sequence)
    with self._lock:
      self._copies[step] = man
    if self.link is not None:
      sent = self._replicate(step, own)
      if sent is False:  # Not kept by the neighbour: this worker's part is not done.
        self.generations.void(step)
        self.prune()
        return
      # A neighbour that kept the state knows; the others are told.
      self.link.report_done(step, skip=(self.link.neighbour,) if sent else ())
    self.generations.done(self.worker, step)
    self.prune()

  def _next_sequence(self) -> int:
    """The sequence number of the next record this worker commits (higher than every record it holds)."""
    with self._lock:
      self._sequence += 1
      return self._sequence

  def _free_slot(self) -> int | None:
    """The slot a new copy may fill, its record deleted; may wait (None: skip it; see slot_choice)."""
    with self._lock:
      by_slot, free = slot_choice.held(self.layout, self._copies)
    got = slot_choice.for_save(by_slot, free, self.generations, self._timeout, self._lost)
    if got is None:
      logging.log_first_n(logging.WARNING, "tfdp: a local save found no slot it may fill (a "
                          "worker is lost, or none reported for %.0fs); skipped.", 1,
                          self._timeout)
    elif got[1] is not None:
      self.delete(self.layout.prefix(got[1]))
    return None if got is None else got[0]

  def _lost(self) -> bool:
    """Whether the side channel is closed or a worker's connection to it ended (it will report no more)."""
    return self.link is not None and (not self.link.open or bool(self.link.gone))

  @property
  def costs(self) -> list[tuple[float, float]]:
    """(seconds the caller was blocked, the writer thread's CPU seconds) of the latest saves."""
    return list(zip(self.cadence.blocked, self._queue.cpu_seconds))

  def _base(self, meta) -> manifest_lib.Manifest:
    """The manifest fields of a save with `meta` known before it is written."""
    return manifest_lib.Manifest(**dataclasses.asdict(meta), world_size=self.num_workers,
                                 session=self._session, writers={str(self.worker): {"files": 1}})

  def _replicate(self, step, own) -> bool | None:
    """Sends this worker's per-worker Items at `step` to its neighbour: acknowledged (None: it has none)."""
    root = layout_lib.per_worker_prefix(self.worker)
    own = {it.key[len(root):]: items_lib.writable(it.value) for it in own}
    return self.link.replicate(step, own, self.token) if own else None

  def _keep_replica(self, source, step, header, blobs):
    """Keeps the left neighbour's per-worker state at `step` (a side-channel thread calls it)."""
    if header["token"] != self.token:
      raise wire.Refused("a per-worker state of another run", "token")
    self.replicas.put(source, step, header, blobs)
    self.generations.done(source, step)  # Its copy is committed and its state is here.
    self.prune()

  def kept_for_left(self) -> list[int]:
    """Steps of the per-worker states this worker keeps of its left neighbour (of this run)."""
    if self.link is None:
      return []
    kept = ((s, self.replicas.get(self.link.left, s)) for s in self.replicas.steps(self.link.left))
    return [s for s, found in kept if found is not None and found[0].get("token") == self.token
            and found[0].get("world_size") == self.num_workers]

  def send_of(self, held: Held) -> tuple[str, int]:
    """(the slot file, its bytes) of local copy `held` that a holder sends."""
    return copies.send(self.layout, held.manifest)

  def receiving(self, keep: int | None) -> None:
    """A restore is about to receive a copy from a peer; `keep`: the step it falls back to if that fails.

    The received bytes then never land in the slot of `keep` (see `_incoming`).
    """
    self._keep = keep

  def _incoming(self, step, manifest_json, sizes):
    """Where the bytes of a copy a peer sends go (the side channel asks, before it reads them).

    Once the offer is checked: a slot slot_choice.for_incoming picks (never
    that of the step `receiving` named). Its record is deleted first: its
    bytes are overwritten from here on.
    """
    offer = copies.incoming(self.layout, None, step, manifest_json, sizes)
    with self._lock:
      if step in self._copies:
        self.delete(self.layout.prefix(step))
      k, replaced = slot_choice.for_incoming(*slot_choice.held(self.layout, self._copies),
                                             self._keep)
      if replaced is not None:
        self.delete(self.layout.prefix(replaced))
      offer.slot = self.slots[k]
      return offer

  def receive(self, step: int, offered: copies.Incoming, own: dict | None) -> Held:
    """Makes a copy a peer sent (its bytes received into a slot) this worker's copy of `step`.

    With `own` (this worker's per-worker tensors, kept by its neighbour), they
    are added after it, as a save would have held them.
    """
    root = layout_lib.per_worker_prefix(self.worker)
    items = [planner.Item(root + k, "", v, 0) for k, v in sorted((own or {}).items())]
    base = self._base(manifest_lib.SaveMeta(offered.manifest.checkpoint_number,
                                            offered.manifest.step))
    sequence = self._next_sequence()
    man = copies.adopt(offered.slot, self.layout.prefix(step), offered, items, base,
                       self.worker, sequence)
    with self._lock:
      self._copies[step] = man
    return Held(step, self.layout.prefix(step), man)

  def wait(self) -> None:
    """Waits for the background save; a failed one is logged (training goes on)."""
    self._queue.wait()

  # -- what is held --

  def committed(self) -> list[str]:
    """Prefixes of this worker's committed local checkpoints, oldest first."""
    with self._lock:
      return [self.layout.prefix(s) for s in sorted(self._copies)]

  def held(self) -> list[Held]:
    """This worker's intact local checkpoints of this run, newest first.

    Each record and its slot's size are checked (every tensor's CRC32C is
    checked when a copy is restored); one of another run, another world
    size or damaged is deleted, with a warning.
    """
    out = []
    for prefix in reversed(self.committed()):
      man = manifest_lib.read_manifest(prefix)
      problem = held_copies.problem(self.layout, prefix, man, self.token, self.num_workers)
      if problem is not None:
        if man is None or man.run_token == self.token:
          logging.warning("tfdp: deleting local checkpoint %s: %s", prefix, problem)
        self.delete(prefix)
        continue
      out.append(Held(man.step, prefix, man))
    return out

  def delete(self, prefix: str) -> None:
    """Deletes local copy `prefix`: its manifest first, so a crash leaves no committed half."""
    with self._lock:
      self._copies.pop(layout_lib.number_of(prefix), None)
      commit_lib.delete(self.layout, prefix)

  def prune(self) -> None:
    """Lets go of the copies and kept states that `generations` no longer needs."""
    with self._lock:
      for step in self.generations.doomed(self._copies):
        self.delete(self.layout.prefix(step))
      for source in self.replicas.sources() if self.link is not None else ():
        kept = self.replicas.steps(source)
        if self.link is not None and source != self.link.left:
          doomed = kept  # Of a neighbour of another world size.
        else:
          doomed = self.generations.doomed(kept)
        for step in doomed:
          self.replicas.delete(source, step)

  def drop_step(self, step: int) -> None:
    """Deletes this worker's copy and kept states of `step` (a restore of it failed)."""
    with self._lock:
      self.delete(self.layout.prefix(step))
      for source in self.replicas.sources():
        self.replicas.delete(source, step)

  def restored(self, step: int | None, tier: str | None) -> None:
    """After a restore at `step` from `tier` (None: a fresh start): copies newer than it are deleted.

    So is a copy of the same step when it is not the one restored (the
    persistent tier's was). What an abandoned attempt saved past the
    restored step can then never be restored, or stand in for a save, on
    any worker. The recovery markers go too.
    """
    own_ok = tier in ("local", "peer")
    newer = (lambda s: True) if step is None else (lambda s: s > step or (s == step and not own_ok))
    with self._lock:
      for s in [s for s in self._copies if newer(s)]:
        self.delete(self.layout.prefix(s))
      for source in self.replicas.sources():
        for s in self.replicas.steps(source):
          if newer(s):
            self.replicas.delete(source, s)
    self.generations.restored(step)
    held_copies.clear_recovery(self.layout)

  def mark_recovery(self, step: int) -> None:
    """Notes, before a peer recovery of `step` starts, that it is under way (see `failed_recovery`)."""
    held_copies.mark_recovery(self.layout, step)

  def failed_recovery(self) -> list[int]:
    """Steps of peer recoveries that an earlier attempt started and never finished (it crashed).

    Their copies and kept states are deleted here, so the workers'
    offers differ from the ones that led to the crash.
    """
    steps = self.layout.recovery_steps()
    for step in steps:
      logging.warning("tfdp: a peer recovery of step %d did not finish (the job stopped during "
                      "it); not trying a peer recovery again now.", step)
      self.drop_step(step)
    return steps

  def close(self) -> None:
    """Waits for the background save, then ends the side channel."""
    self.wait()
    if self.link is not None:
      self.link.close()
    for slot in self.slots:
      slot.close()

  def drop(self) -> None:
    """Deletes every local checkpoint and the slots (e.g. once training completed and the persistent tier has the end)."""
    self.wait()
    for prefix in self.committed():
      self.delete(prefix)
    for slot in self.slots:
      slot.close()
      if os.path.exists(slot.path):
        os.remove(slot.path)
    self.replicas.drop()
    held_copies.clear_recovery(self.layout)
