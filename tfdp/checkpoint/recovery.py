"""The tiers at restore: the newest state the workers can have, agreed, and a lost local copy recovered from peers."""

import dataclasses
import time

from absl import logging
import numpy as np

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.local import generations
from tfdp.checkpoint.local import tier as local_lib
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import restorer as restorer_lib
from tfdp.checkpoint.local import phases as phases_lib
from tfdp.checkpoint.local import wire

SLOTS = generations.MAX_KEEP  # Own copies and kept states each worker offers.

# Outcomes of one worker's part of an attempt, ordered: the agreement is the worst.
OK, FAILED, REFUSED = 0, 1, 2  # REFUSED: before_restore raised (the caller's error).


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

  def describe(self) -> str:
    return "the persistent tier" if self.kind == "persistent" else f"{self.kind} step {self.step}"


def offer(held: list[local_lib.Held], persistent_step: int | None,
          kept_for_left: list[int] = (), *, no_peer: bool = False, link: bool = True) -> list[float]:
  """This worker's row of the agreement.

  [persistent step + 1, (step + 1, required) x SLOTS of its own copies,
  step + 1 x SLOTS of the per-worker states it keeps of its left
  neighbour, no peer recovery, side channel open], newest first, 0 for none.
  """
  row = [0.0 if persistent_step is None else persistent_step + 1.0]
  for i in range(SLOTS):
    if i < len(held):
      row += [held[i].step + 1.0, 1.0 if held[i].manifest.per_worker_required else 0.0]
    else:
      row += [0.0, 0.0]
  kept = sorted(kept_for_left, reverse=True)[:SLOTS]
  return row + [s + 1.0 for s in kept] + [0.0] * (SLOTS - len(kept)) + [
      1.0 if no_peer else 0.0, 1.0 if link else 0.0]


def choose(table) -> Choice:
  """The newest state the workers can have, from every worker's `offer` row (pure).

  The newest step any worker holds locally wins when it is newer than the
  persistent tier's (or as new, and held by every worker): "local" when
  every worker holds it; "peer" when some do and each of the others can get
  its per-worker state (when the step's is required: a plain `fit`'s data
  position) from its neighbour, unless a worker said no peer recovery (one
  just failed) or a side channel is closed. Otherwise the next older local
  step is tried, and at last the persistent tier.
  """
  table = np.asarray(table, np.float64)
  n = len(table)
  persistent = int(table[:, 0].min()) - 1  # -1: none (0 on any worker).
  peer_ok = not table[:, -2].any() and table[:, -1].all()
  holders, required, kept = {}, {}, {}
  for w, row in enumerate(table):
    for i in range(SLOTS):
      step = int(row[1 + 2 * i]) - 1
      if step >= 0:
        holders.setdefault(step, []).append(w)
        required[step] = required.get(step, False) or bool(row[2 + 2 * i])
    # Worker w keeps the per-worker states of worker w - 1.
    kept[(w - 1) % n] = {int(s) - 1 for s in row[1 + 2 * SLOTS:1 + 3 * SLOTS] if s > 0}
  for step in sorted(holders, reverse=True):
    if step < persistent:
      break
    who = tuple(sorted(holders[step]))
    if len(who) == n:
      return Choice("local", step, who)
    missing = [w for w in range(n) if w not in who]
    if peer_ok and step > persistent and (
        not required[step] or all(step in kept[w] for w in missing)):
      return Choice("peer", step, who, per_worker=required[step])
  return Choice("persistent")


def fallback(table, step: int) -> int | None:
  """The newest step older than `step` that every worker holds a copy of, from the `offer` rows (pure).

  What `choose` falls back to when a peer recovery of `step` fails (or
  older: the persistent tier, when it is newer). A receiver keeps its copy
  of it while the bytes of `step` land.
  """
  table = np.asarray(table, np.float64)
  held = [{int(s) - 1 for s in row[1:1 + 2 * SLOTS:2] if s > 0} for row in table]
  common = [s for s in set.intersection(*held) if s < step] if held else []
  return max(common, default=None)


# -- the protocol --

def restore_newest(checkpoint, tier: local_lib.LocalTier | None, me: cluster.Worker,
                   restorer: restorer_lib.Restorer, before_restore=None) -> restorer_lib.Restored | None:
  """Restores the newest state the workers can have, from any tier, agreed (every worker calls it).

  The local tiers first (`TieredRestore`), then the persistent checkpoints
  (`Restorer.newest_intact`). When anything failed on the way, the chief
  logs one line: what was tried (and set aside, and why), and what was
  restored. A fresh start (None) after failed attempts starts from the
  state before them (`Restorer.put_back`), and deletes the local copies, as
  a restore deletes those newer than it.
  """
  found, tried = None, []
  restorer.applied = False
  if tier is not None:
    tier.wait()
    tiered = TieredRestore(checkpoint, tier, me, restorer.restore_per_worker,
                           restorer.before_apply, restorer.check_model, phases=tier.phases)
    found = tiered.run(restorer.newest_step(), before_restore)
    tried = tiered.tried
  found = found or restorer.newest_intact(before_restore, tried)
  if found is not None:
    restorer.settle()
  if tried and me.is_chief:
    logging.warning("tfdp: restore: tried %s; restored %s.", ", then ".join(tried),
                    f"{found.prefix} ({found.tier} tier)" if found else
                    "nothing: a fresh start from the initial state")
  if found is None and tried and cluster.agree(
      0.0 if restorer.put_back() else 1.0, "max", me.strategy):
    # A failed attempt restored part of the state on some worker, and its
    # values before cannot be put back: starting over now would start the
    # workers from different states.
    raise errors.CheckpointError(
        f"Nothing could be restored ({', then '.join(tried)}), and a failed attempt had "
        "already restored part of the state on a worker: not starting over with it. Run "
        "the job again: what failed is deleted or set aside, so it starts over cleanly.")
  if found is None and tier is not None:
    tier.restored(None, None)
  return found


class TieredRestore:
  """Restores the newest state the workers can have from the local tiers (every worker runs it).

  1. each worker lists its intact local copies, the per-worker states it
     keeps of its neighbour and the newest persistent step, and one
     all-reduce gives every worker every worker's list;
  2. `choose` picks, the same on every worker: the newest local step held
     by all ("local"), or held by some and recoverable ("peer"), else the
     persistent tier;
  3. the holders restore their own copy; after one all-reduce of their
     outcome, the first holder sends each worker without one the copy
     (its record and slot), and its neighbour its per-worker state, over the side channel
     (tfdp.checkpoint.local.peers); that worker makes them its own local copy
     (`LocalTier.receive`) and restores it;
  4. one all-reduce of every worker's outcome: any failure (a damaged copy,
     a read error, a transfer cut short or timed out) moves every worker
     to the next candidate together. The failed step's copies are deleted
     on every worker, and after a failed transfer no peer recovery is tried
     again, so the next choice differs: an older step all hold, then the
     persistent tier. Before a transfer every worker notes it on disk
     (`LocalTier.mark_recovery`): a restart after a crash during one
     (a holder SIGKILLed) deletes that step's copies and tries no peer
     recovery, instead of making the same choice again.

  Args:
    checkpoint: the `tf.train.Checkpoint` to restore into.
    tier: this worker's `LocalTier` (with its side channel when N > 1).
    me: this worker (`tfdp.distribute.cluster.Worker`, with its strategy).
    restore_per_worker: `fn(prefix, manifest, reader)` restoring this worker's
      own per-worker state from a copy's tensors.
    before_apply: called before a restore may change the state
      (`Restorer.before_apply`).
    check_model: `fn(prefix)` raising IncompatibleCheckpointError for a copy
      of another model (`Restorer.check_model`), before anything is
      assigned; else its `model_match.ModelMatch` (None: TF's keys).
    phases: where the seconds of each phase are added
      (tfdp.checkpoint.local.phases; None: a new one, `self.phases`).
  """

  def __init__(self, checkpoint, tier: local_lib.LocalTier, me: cluster.Worker,
               restore_per_worker, before_apply=lambda: None, check_model=lambda prefix: None,
               phases: phases_lib.PhaseTimes | None = None):
    self.phases = phases if phases is not None else phases_lib.PhaseTimes()
    self._checkpoint = checkpoint
    self._tier = tier
    self._me = me
    self._restore_per_worker = restore_per_worker
    self._before_apply = before_apply
    self._check_model = check_model
    self.tried = []  # What was tried and failed, for the one line the caller logs.
    self._received = None  # This worker's copy made of what a peer sent.
    self._refusal = None  # What before_restore raised on this worker.

  def run(self, persistent_step: int | None, before_restore=None) -> restorer_lib.Restored | None:
    """Restores from the local tiers; None: use the persistent tier (nothing was restored)."""
    # tf.train.Checkpoint makes its save counter on the first restore; under
    # a MultiWorkerMirroredStrategy that is a broadcast, so every worker
    # makes it here, not only those that restore before the others.
    self._checkpoint.save_counter  # pylint: disable=pointless-statement
    tier = self._tier
    no_peer = bool(tier.failed_recovery())
    if no_peer:
      self.tried.append("a peer recovery that an earlier attempt did not finish")
    # Each failed round deletes a step's copies: bounded by what is held.
    for _ in range(2 * SLOTS + 2):
      with self.phases.timed("held"):
        held = tier.held()
      link = tier.link is not None and tier.link.open
      row = offer(held, persistent_step, tier.kept_for_left(), no_peer=no_peer,
                  link=link or self._me.count == 1)
      with self.phases.timed("agree"):
        table = cluster.gather(row, self._me.strategy)
      choice = choose(table)
      if choice.kind == "persistent":
        return None
      start = time.perf_counter()
      mine = next((h for h in held if h.step == choice.step), None)
      if mine is None:
        tier.receiving(keep=fallback(table, choice.step))
      seconds = {}
      outcome, failed = self._attempt(choice, mine, before_restore, seconds)
      if outcome == OK:
        self._log(choice, self._received or mine, time.perf_counter() - start, seconds)
        return restorer_lib.Restored((self._received or mine).prefix,
                                    (self._received or mine).manifest, choice.kind)
      self.tried.append(f"{choice.describe()} (failed on worker(s) {failed})")
      tier.drop_step(choice.step)
      no_peer = no_peer or choice.kind == "peer"
    return None

  def _attempt(self, choice, mine, before_restore, seconds):
    """One choice, on every worker: (the agreed outcome, the workers where it failed)."""
    self._received = None
    outcome = self._restore(mine, before_restore) if mine is not None else OK
    if choice.kind == "peer":
      link, n, me = self._tier.link, self._me.count, self._me.index
      missing = [w for w in range(n) if w not in choice.holders]
      waits = []
      if me in missing:  # Registered before the agreement lets the senders send.
        waits.append(link.expect(wire.COPY, choice.step, choice.holders[0]))
        if choice.per_worker:
          waits.append(link.expect(wire.PER_WORKER_COPY, choice.step, (me + 1) % n))
      self._tier.mark_recovery(choice.step)
      worst, failed = self._agree(outcome)
      if worst != OK:
        for key in waits:
          link.forget(key)
        return worst, failed
      outcome = self._transfer(choice, mine, missing, waits, before_restore, seconds)
    return self._agree(outcome)

  def _transfer(self, choice, mine, missing, waits, before_restore, seconds):
    """Sends what others lack, or receives and restores it; returns this worker's outcome."""
    me, link, n, tier = self._me.index, self._tier.link, self._me.count, self._tier
    try:
      if me == choice.holders[0]:
        for w in missing:
          with self.phases.timed("send"):
            link.send_copy(w, choice.step, mine.manifest.to_json(), *tier.send_of(mine))
      if choice.per_worker:
        for w in missing:
          if (w + 1) % n == me:
            header, blobs = tier.replicas.get(w, choice.step)
            link.send_state(w, choice.step, header["keys"], header["token"], blobs)
      if not waits:
        return OK
      start = time.perf_counter()
      _, offered = link.wait(waits[0])
      own = None
      if choice.per_worker:
        header, blobs = link.wait(waits[1])
        own = wire.tensors_from_wire(header, blobs)
      seconds["transfer"] = time.perf_counter() - start
      self.phases.add("wait", seconds["transfer"])
      self.phases.merge(offered.times)
      self._received = tier.receive(choice.step, offered, own)
      seconds["write"] = time.perf_counter() - start - seconds["transfer"]
      self.phases.add("commit", seconds["write"])
      outcome = self._restore(self._received, before_restore, per_worker=choice.per_worker,
                              received=True)
      seconds["restore"] = time.perf_counter() - start - sum(seconds.values())
      return outcome
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: the peer recovery of step %d failed on this worker: %s",
                      choice.step, e)
      return FAILED

  def _restore(self, held, before_restore, per_worker=True, received=False):
    """Restores one local copy; returns OK, FAILED or REFUSED (before_restore raised).

    Every tensor's CRC32C is checked before anything is assigned: a damaged
    copy changes nothing (a copy `received` from a peer a moment ago was
    checked as its bytes landed, and is not checked again). TF can read the
    copy from here on (for `before_restore`'s checks and what reads the
    restored copy after).
    """
    layout = self._tier.layout
    try:
      with self.phases.timed("index"):
        copies.readable(layout, held.prefix, held.manifest)
    except (OSError, TypeError, ValueError) as e:
      logging.warning("tfdp: could not restore the local checkpoint %s: %s", held.prefix, e)
      return FAILED
    try:
      with self.phases.timed("before_restore"):
        if before_restore is not None:
          before_restore(held.prefix)
        match = self._check_model(held.prefix)
    except Exception as e:  # pylint: disable=broad-except
      self._refusal = e
      return REFUSED

    def applying():
      self._before_apply()  # From here on the state may be changed, even if it fails.

    try:
      if match is None or match.exact:
        tensors = copies.restore(self._checkpoint, layout, held.prefix, held.manifest, applying,
                                 received=received, times=self.phases)
        reader = copies.per_worker_reader(tensors)
      else:  # Through TF's reader of the copy (its index), under the checkpoint's keys.
        applying()
        restore_lib.restore_matched(self._checkpoint, held.prefix, held.manifest, match)
        reader = None
      if per_worker:
        with self.phases.timed("per_worker"):
          self._restore_per_worker(held.prefix, held.manifest, reader)
      return OK
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: could not restore the local checkpoint %s: %s", held.prefix, e)
      return FAILED

  def _agree(self, outcome):
    """(The worst outcome of any worker, the workers where it failed); a refusal is raised everywhere."""
    with self.phases.timed("agree"):
      codes = cluster.gather([outcome], self._me.strategy)[:, 0]
    worst = int(codes.max())
    if worst == REFUSED:
      if outcome == REFUSED:
        raise self._refusal
      raise errors.CheckpointError(
          "Another worker refused the checkpoint to restore (its log says why).")
    return worst, [w for w, c in enumerate(codes) if c != OK]

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
