"""The tiers at restore: the newest state the workers can have, and a lost local copy recovered from a peer."""

import dataclasses
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import items as items_lib
from tfdp.checkpoint import local as local_lib
from tfdp.checkpoint import planner
from tfdp.checkpoint import restore as restore_lib

LOCAL_KEEP = local_lib.LOCAL_KEEP

# Outcomes of one worker's restore in the protocol.
_OK = "ok"
_DAMAGED = "damaged"


# -- choosing what to restore --

@dataclasses.dataclass(frozen=True)
class Choice:
  """What every worker restores: `kind` is "local", "peer" or "persistent"."""
  kind: str
  step: int | None = None
  holders: tuple[int, ...] = ()


def offer(held: list[local_lib.Held], persistent_step: int | None) -> list[float]:
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


# -- the protocol --

class TieredRestore:
  """Restores the newest state the workers can have from the local tiers (every worker runs it).

  1. each worker lists its intact local copies and the newest persistent
     step, and one all-reduce gives every worker every worker's list;
  2. `choose` picks, the same on every worker: the newest local step held
     by all ("local"), or held by some and recoverable without per-worker
     state ("peer"), else the persistent tier;
  3. the holders restore their own copy; after one all-reduce of their
     outcome, the others get each tensor from the first holder, write it as
     a local copy and restore it;
  4. a worker whose copy turned out damaged deletes it, and all go back to 1.

  Args:
    checkpoint: the `tf.train.Checkpoint` to restore into.
    tier: this worker's `LocalTier`.
    me: this worker (`tfdp.cluster.Worker`, with its strategy).
    restore_per_worker: `fn(prefix, manifest)` restoring this worker's own
      per-worker state from a copy.
    recovered_meta: `fn(step)` -> the SaveMeta of a copy received from a peer.
  """

  def __init__(self, checkpoint, tier: local_lib.LocalTier, me: cluster.Worker,
               restore_per_worker, recovered_meta):
    self._checkpoint = checkpoint
    self._tier = tier
    self._me = me
    self._restore_per_worker = restore_per_worker
    self._recovered_meta = recovered_meta

  def run(self, persistent_step: int | None, before_restore=None) -> restore_lib.Restored | None:
    """Restores from the local tiers; None: use the persistent tier (nothing was restored)."""
    # tf.train.Checkpoint makes its save counter on the first restore; under
    # a MultiWorkerMirroredStrategy that is a broadcast, so every worker
    # makes it here, not only those that restore before the others.
    self._checkpoint.save_counter  # pylint: disable=pointless-statement
    for _ in range(LOCAL_KEEP + 1):
      held = self._tier.held()
      choice = choose(cluster.gather(offer(held, persistent_step), self._me.strategy))
      if choice.kind == "persistent":
        if self._me.is_chief and held:
          logging.info("tfdp: no local copy is newer than the persistent tier (step %s).",
                       persistent_step)
        return None
      start = time.perf_counter()
      mine = next((h for h in held if h.step == choice.step), None)
      outcome = self._restore(mine, before_restore) if mine is not None else _OK
      phases = {}
      if choice.kind == "peer":
        if self._agree(outcome) != _OK:
          continue
        mine, outcome = self._from_peer(choice, mine, before_restore, phases)
      if self._agree(outcome) != _OK:
        continue
      self._log(choice, mine, time.perf_counter() - start, phases)
      return restore_lib.Restored(mine.prefix, mine.manifest, choice.kind)
    return None

  def _from_peer(self, choice, mine, before_restore, phases):
    """Every worker joins the transfer; a worker without the copy writes and restores it."""
    sent = time.perf_counter()
    # The holders' values are the restored ones; the first holder's are sent.
    items = transfer(items_lib.gather(self._checkpoint), choice.holders[0], self._me.strategy)
    phases["transfer"] = time.perf_counter() - sent
    if mine is not None:
      return mine, _OK
    wrote = time.perf_counter()
    try:
      mine = self._tier.write(choice.step, items,
                              self._recovered_meta(choice.step))
    except Exception as e:  # pylint: disable=broad-except
      return None, e  # Raised on every worker by the agreement.
    phases["write"] = time.perf_counter() - wrote
    outcome = self._restore(mine, before_restore, per_worker=False)
    phases["restore"] = time.perf_counter() - wrote - phases["write"]
    return mine, outcome

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
          "tfdp: recovered step %d from worker %d through collectives (this worker "
          "had no local copy): %.1f MB in %.2f s (%s).", choice.step, choice.holders[0],
          mine.manifest.state_bytes / 1e6, seconds,
          ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    elif me.is_chief:
      logging.info("tfdp: restored step %d from the local tier; worker(s) %s got it "
                   "from worker %d.", choice.step,
                   sorted(set(range(me.count)) - set(choice.holders)), choice.holders[0])
