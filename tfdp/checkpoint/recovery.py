"""The tiers at restore: the newest state the workers can have, and a lost local copy recovered from peers."""

import dataclasses
import time

from absl import logging
import numpy as np

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import local as local_lib
from tfdp.checkpoint import peers
from tfdp.checkpoint import restore as restore_lib

LOCAL_KEEP = local_lib.LOCAL_KEEP

# Outcomes of one worker's restore in the protocol.
_OK = "ok"
_DAMAGED = "damaged"


# -- choosing what to restore --

@dataclasses.dataclass(frozen=True)
class Choice:
  """What every worker restores: `kind` is "local", "peer" or "persistent".

  With "peer", the workers not among `holders` get the state from
  `holders[0]`; with `per_worker`, each also gets its own per-worker state
  from its neighbour (worker w's is kept by worker w + 1 mod N).
  """
  kind: str
  step: int | None = None
  holders: tuple[int, ...] = ()
  per_worker: bool = False


def offer(held: list[local_lib.Held], persistent_step: int | None,
          kept_for_left: list[int] = ()) -> list[float]:
  """This worker's row of the agreement.

  [persistent step + 1, (step + 1, required) x LOCAL_KEEP of its own copies,
  step + 1 x LOCAL_KEEP of the per-worker states it keeps of its left
  neighbour], newest first, 0 for none.
  """
  row = [0.0 if persistent_step is None else persistent_step + 1.0]
  for i in range(LOCAL_KEEP):
    if i < len(held):
      row += [held[i].step + 1.0, 1.0 if held[i].manifest.per_worker_required else 0.0]
    else:
      row += [0.0, 0.0]
  kept = sorted(kept_for_left, reverse=True)[:LOCAL_KEEP]
  return row + [s + 1.0 for s in kept] + [0.0] * (LOCAL_KEEP - len(kept))


def choose(table) -> Choice:
  """The newest state the workers can have, from every worker's `offer` row (pure).

  The newest step any worker holds locally wins when it is newer than the
  persistent tier's (or as new, and held by every worker): "local" when
  every worker holds it; "peer" when some do and each of the others can get
  its per-worker state (when the step's is required: a plain `fit`'s data
  position) from its neighbour. Otherwise the next older local step is
  tried, and at last the persistent tier.
  """
  table = np.asarray(table, np.float64)
  n = len(table)
  persistent = int(table[:, 0].min()) - 1  # -1: none (0 on any worker).
  holders, required, kept = {}, {}, {}
  for w, row in enumerate(table):
    for i in range(LOCAL_KEEP):
      step = int(row[1 + 2 * i]) - 1
      if step >= 0:
        holders.setdefault(step, []).append(w)
        required[step] = required.get(step, False) or bool(row[2 + 2 * i])
    # Worker w keeps the per-worker states of worker w - 1.
    kept[(w - 1) % n] = {int(s) - 1 for s in row[1 + 2 * LOCAL_KEEP:] if s > 0}
  for step in sorted(holders, reverse=True):
    if step < persistent:
      break
    who = tuple(sorted(holders[step]))
    if len(who) == n:
      return Choice("local", step, who)
    missing = [w for w in range(n) if w not in who]
    if step > persistent and (not required[step] or all(step in kept[w] for w in missing)):
      return Choice("peer", step, who, per_worker=required[step])
  return Choice("persistent")


# -- the protocol --

class TieredRestore:
  """Restores the newest state the workers can have from the local tiers (every worker runs it).

  1. each worker lists its intact local copies, the per-worker states it
     keeps of its neighbour and the newest persistent step, and one
     all-reduce gives every worker every worker's list;
  2. `choose` picks, the same on every worker: the newest local step held
     by all ("local"), or held by some and recoverable ("peer"), else the
     persistent tier;
  3. the holders restore their own copy; after one all-reduce of their
     outcome, the first holder sends each worker without one the copy's
     files, and its neighbour its per-worker state, over the side channel
     (tfdp.checkpoint.peers); that worker makes them its own local copy
     (`LocalTier.receive`) and restores it;
  4. a worker whose copy turned out damaged deletes it, and all go back to 1.

  Args:
    checkpoint: the `tf.train.Checkpoint` to restore into.
    tier: this worker's `LocalTier` (with its side channel when N > 1).
    me: this worker (`tfdp.cluster.Worker`, with its strategy).
    restore_per_worker: `fn(prefix, manifest)` restoring this worker's own
      per-worker state from a copy.
    timeout: seconds a worker waits for what its peers send.
  """

  def __init__(self, checkpoint, tier: local_lib.LocalTier, me: cluster.Worker,
               restore_per_worker, timeout: float):
    self._checkpoint = checkpoint
    self._tier = tier
    self._me = me
    self._restore_per_worker = restore_per_worker
    self._timeout = timeout

  def run(self, persistent_step: int | None, before_restore=None) -> restore_lib.Restored | None:
    """Restores from the local tiers; None: use the persistent tier (nothing was restored)."""
    # tf.train.Checkpoint makes its save counter on the first restore; under
    # a MultiWorkerMirroredStrategy that is a broadcast, so every worker
    # makes it here, not only those that restore before the others.
    self._checkpoint.save_counter  # pylint: disable=pointless-statement
    link = self._tier.link
    for _ in range(LOCAL_KEEP + 1):
      held = self._tier.held()
      kept = self._tier.kept_for_left()
      choice = choose(cluster.gather(offer(held, persistent_step, kept), self._me.strategy))
      if choice.kind == "persistent":
        if self._me.is_chief and held:
          logging.info("tfdp: no local copy is newer than the persistent tier (step %s).",
                       persistent_step)
        return None
      start = time.perf_counter()
      mine = next((h for h in held if h.step == choice.step), None)
      outcome = self._restore(mine, before_restore) if mine is not None else _OK
      seconds = {}
      if choice.kind == "peer":
        if self._agree(outcome) != _OK:
          continue
        if link is None:  # Unreachable: one worker alone holds it or nothing.
          raise errors.CheckpointError("peer recovery needs the local tier's side channel")
        outcome, mine = self._from_peers(choice, mine, before_restore, seconds)
      if self._agree(outcome) != _OK:
        continue
      self._log(choice, mine, time.perf_counter() - start, seconds)
      return restore_lib.Restored(mine.prefix, mine.manifest, choice.kind)
    return None

  def _from_peers(self, choice, mine, before_restore, seconds):
    """Sends what others lack, or receives and restores it; returns (outcome, the copy restored)."""
    me, link, n = self._me.index, self._tier.link, self._me.count
    missing = [w for w in range(n) if w not in choice.holders]
    try:
      if me == choice.holders[0]:
        for w in missing:
          link.send(w, "copy", choice.step, {"manifest": mine.manifest.to_json()},
                    paths=self._tier.files_of(mine.prefix))
      if choice.per_worker:
        for w in missing:
          if (w + 1) % n == me:
            description, blobs = link.copies.get(w, choice.step)
            link.send(w, "per_worker_copy", choice.step, description, blobs)
      if me not in missing:
        return _OK, mine
      start = time.perf_counter()
      header, paths = link.receive("copy", choice.step, self._timeout)
      own = None
      if choice.per_worker:
        own = link.receive("per_worker_copy", choice.step, self._timeout)
        own = peers.tensors_from_wire(*own)
      seconds["transfer"] = time.perf_counter() - start
      received = self._tier.receive(choice.step, header, paths, own)
      seconds["write"] = time.perf_counter() - start - seconds["transfer"]
      outcome = self._restore(received, before_restore, per_worker=choice.per_worker)
      seconds["restore"] = time.perf_counter() - start - sum(seconds.values())
      return outcome, received
    except Exception as e:  # pylint: disable=broad-except
      return e, mine  # Raised on every worker by the agreement.

  def _restore(self, held, before_restore, per_worker=True):
    """Restores one local copy; returns _OK, _DAMAGED (the copy is deleted) or the exception."""
    try:
      if before_restore is not None:
        before_restore(held.prefix)
      restore_lib.restore_verified(self._checkpoint, held.prefix, held.manifest)
      if per_worker:
        self._restore_per_worker(held.prefix, held.manifest)
      return _OK
    except errors.CorruptCheckpointError as e:
      logging.warning("tfdp: deleting a damaged local checkpoint: %s", e)
      self._tier.delete(held.prefix)
      return _DAMAGED
    except Exception as e:  # pylint: disable=broad-except
      return e

  def _agree(self, outcome):
    """The worst outcome of any worker; a failure other than damage is raised on every worker."""
    code = 0 if outcome is _OK else 1 if outcome is _DAMAGED else 2
    worst = int(cluster.agree(code, "max", self._me.strategy))
    if worst == 2:
      if isinstance(outcome, Exception):
        raise outcome
      raise errors.CheckpointError(
          "Another worker failed to restore its local checkpoint (its log says why).")
    return _OK if worst == 0 else _DAMAGED

  def _log(self, choice, mine, seconds, phases):
    me = self._me
    if choice.kind == "local":
      if me.is_chief:
        logging.info("tfdp: restored step %d from the local tier (each worker's own "
                     "copy, %.2f s).", choice.step, seconds)
    elif me.index not in choice.holders:
      logging.warning(
          "tfdp: recovered step %d from worker %d over the side channel (this worker "
          "had no local copy%s): %.1f MB in %.2f s (%s).", choice.step, choice.holders[0],
          "; its data position from worker %d" % ((me.index + 1) % me.count)
          if choice.per_worker else "", mine.manifest.total_bytes / 1e6, seconds,
          ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    elif me.is_chief:
      logging.info("tfdp: restored step %d from the local tier; worker(s) %s got it "
                   "from worker %d.", choice.step,
                   sorted(set(range(me.count)) - set(choice.holders)), choice.holders[0])
