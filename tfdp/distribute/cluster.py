"""Who this process is in the job (index, count, chief, address), and one tiny agreement across workers."""

from __future__ import annotations

import collections
import dataclasses
import secrets
from typing import Any, Iterable

from tfdp.distribute import environment
from tfdp import errors

OPS = ("max", "min", "sum")

_FIX = ("build and compile the model inside `with strategy.scope():` of "
        "`strategy = tfdp.make_strategy()` (a MultiWorkerMirroredStrategy; tfdp "
        "finds it through the model's variables), or pass strategy=<that "
        "strategy> to the tfdp.CheckpointManager")


@dataclasses.dataclass(frozen=True)
class Worker:
  """This process's place in the job.

  Attributes:
    index: 0..count-1. The chief (the TF_CONFIG `chief` task if any, else
      worker 0) is 0; `worker:i` is i+1 when a chief task exists.
    count: number of training tasks (chief + workers).
    address: this task's `host:port`, when known.
    strategy: the MultiWorkerMirroredStrategy that says so (None for a single
      worker without one, and when the caller gave index and count).
    task: (TF task type, task id), when known, e.g. ("worker", 1).
    peers: the other training tasks, as (task type, task id) pairs.
    addresses: every worker's `host:port` by index, when known.
  """

  index: int
  count: int
  address: str | None = None
  strategy: Any = None
  task: tuple[str, int] | None = None
  peers: tuple[tuple[str, int], ...] = ()
  addresses: tuple[str, ...] = ()

  @property
  def is_chief(self) -> bool:
    """True on the one worker that cleans up, commits and prints progress."""
    return self.index == 0


# -- Who this process is -----------------------------------------------------


def _from_environment() -> Worker:
  """The worker the environment describes, for a process without a multi-worker strategy."""
  described = environment.described()
  if described.task and described.task[0] not in environment.TASK_TYPES:
    raise errors.ConfigError(
        f"TF_CONFIG says this process is the {described.task[0]!r} task, which "
        "is not a training worker: pass worker_index= and num_workers= "
        "explicitly.")
  if described.count > 1:
    raise errors.ConfigError(
        f"{described.where} describes {described.count} workers (this is "
        f"worker {described.index}) but no MultiWorkerMirroredStrategy was "
        f"found: {_FIX}, so that every worker knows its place in the job "
        "(without it each worker would act as the only one, and they would "
        "overwrite each other's checkpoints). Or pass worker_index= and "
        "num_workers= explicitly.")
  return Worker(0, 1, described.address, None, described.task)


# -- Strategies ---------------------------------------------------------------


def is_multi_worker(strategy: Any) -> bool:
  """Whether `strategy` is a MultiWorkerMirroredStrategy spanning more than one worker."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
          and getattr(strategy.extended, "_num_workers", 1) > 1)


def _from_strategy(strategy) -> Worker:
  """The worker a MultiWorkerMirroredStrategy says this process is.

  Reads what the strategy fixed at construction (its extended's cluster
  spec and task), not its cluster resolver, which re-reads TF_CONFIG.
  """
  # pylint: disable=protected-access
  extended = strategy.extended
  count = getattr(extended, "_num_workers", 1)
  spec = getattr(extended, "_cluster_spec", None)
  task_type, task_id = getattr(extended, "_task_type", None), getattr(extended, "_task_id", None)
  # pylint: enable=protected-access
  if count <= 1 or not task_type or spec is None:
    return Worker(0, 1, None, strategy)
  task_id = int(task_id)
  try:
    address = spec.task_address(task_type, task_id)
  except (ValueError, KeyError):
    address = None
  peers = tuple((job, i) for job in spec.jobs if job in environment.TASK_TYPES
                for i in range(spec.num_tasks(job)) if (job, i) != (task_type, task_id))
  cluster_dict = spec.as_dict()
  index = environment.worker_index(task_type, task_id, cluster_dict)
  addresses = [None] * int(count)
  for job in environment.TASK_TYPES:
    for i, a in enumerate(cluster_dict.get(job, [])):
      addresses[environment.worker_index(job, i, cluster_dict)] = a
  return Worker(index, int(count), address, strategy, (task_type, task_id), peers,
                tuple(addresses))


def _unwrap(obj):
  """A keras.Variable's backing tf.Variable; anything else as is."""
  import keras  # pylint: disable=g-import-not-at-top
  if isinstance(obj, keras.Variable):
    inner = getattr(obj, "_value", None)
    return obj.value if inner is None else inner
  return obj


def strategy_of(objects: Any) -> Any:
  """The MultiWorkerMirroredStrategy that owns distributed variables reachable from `objects`.

  Args:
    objects: a `tf.train.Checkpoint`, a Keras model or layer, a variable, or
      an iterable or dict of these. Trackables are walked through their
      checkpoint dependencies; `keras.Variable`s are unwrapped.

  Returns:
    The strategy of the first distributed variable found if it is a
    MultiWorkerMirroredStrategy, else None.
  """
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tensorflow.python.checkpoint import trackable_view
  from tensorflow.python.trackable import base
  from tensorflow.python.util import object_identity
  # pylint: enable=g-import-not-at-top
  mwms = tf.distribute.MultiWorkerMirroredStrategy
  seen = object_identity.ObjectIdentitySet()
  queue = collections.deque([objects])
  while queue:
    obj = _unwrap(queue.popleft())
    if obj is None or obj in seen:
      continue
    seen.add(obj)
    if isinstance(obj, tf.distribute.DistributedValues):
      strategy = getattr(obj, "_distribute_strategy", None)
      return strategy if isinstance(strategy, mwms) else None
    if isinstance(obj, tf.Variable):
      # A plain variable (e.g. a step counter made outside the scope) says
      # nothing; look on.
      continue
    if isinstance(obj, dict):
      queue.extend(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
      queue.extend(obj)
    elif isinstance(obj, base.Trackable):
      try:
        queue.extend(trackable_view.TrackableView.children(obj).values())
      except Exception:  # pylint: disable=broad-except
        # Some trackables cannot list their children outside a save (e.g.
        # ones that build them lazily); they own no variable we could use.
        continue
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
      queue.extend(obj)
  return None


def resolve(strategy: Any = None, *, objects: Any = None,
            worker_index: int | None = None,
            num_workers: int | None = None) -> Worker:
  """Which worker of the job this process is.

  In this order: explicit `worker_index` and `num_workers`; the strategy
  passed; the strategy in scope; the MultiWorkerMirroredStrategy that owns
  the distributed variables of `objects`; TF_CONFIG or SLURM. The first
  MultiWorkerMirroredStrategy found decides.

  Args:
    strategy: a `tf.distribute.Strategy`, or None.
    objects: what to look for distributed variables in (see `strategy_of`),
      e.g. the `tf.train.Checkpoint` a checkpoint manager saves.
    worker_index: this worker's index, with `num_workers`.
    num_workers: number of workers, with `worker_index`.

  Returns:
    A `Worker`.

  Raises:
    ConfigError: only one of worker_index and num_workers, an index out of
      range, a bad TF_CONFIG, or an environment (TF_CONFIG or SLURM) that
      names more than one worker while no MultiWorkerMirroredStrategy was
      found (it says what to pass).
  """
  if (worker_index is None) != (num_workers is None):
    raise errors.ConfigError(
        "Pass both worker_index and num_workers, or neither (then the "
        "MultiWorkerMirroredStrategy in scope decides).")
  if worker_index is not None:
    if not 0 <= worker_index < num_workers:
      raise errors.ConfigError(
          f"worker_index={worker_index} must be in [0, num_workers="
          f"{num_workers}).")
    return Worker(int(worker_index), int(num_workers))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  mwms = tf.distribute.MultiWorkerMirroredStrategy
  in_scope = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  found = next((s for s in (strategy, in_scope) if isinstance(s, mwms)), None)
  if found is None and objects is not None:
    found = strategy_of(objects)
  if found is None:
    return _from_environment()
  worker = _from_strategy(found)
  if worker.count == 1:
    described = environment.described()
    if described.count > 1:
      raise errors.ConfigError(
          f"{described.where} describes {described.count} workers but the "
          "MultiWorkerMirroredStrategy found spans one: build "
          "it after TF_CONFIG is set (tfdp.make_strategy reads TF_CONFIG and "
          "SLURM), or pass worker_index= and num_workers= explicitly.")
  return worker


def peers(strategy: Any) -> tuple[tuple[str, int], ...]:
  """The other training tasks of a multi-worker `strategy`; () for anything else."""
  if not is_multi_worker(strategy):
    return ()
  return _from_strategy(strategy).peers


# -- Agreement ----------------------------------------------------------------


def gather(values, strategy: Any = None):
  """One small all-reduce: every worker's `values`, as a [workers, len(values)] array, the same on every worker.

  Each worker contributes its vector once, from its first local replica.
  Every worker must call it at the same point of the program, with vectors
  of the same length, as any collective.

  Args:
    values: this worker's numbers (integers up to 2**53 come back exact).
    strategy: the multi-worker strategy; None: the one in scope.

  Returns:
    A float64 numpy array, row w holding worker w's values; one row when
    there is no multi-worker strategy.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  own = [float(v) for v in values]
  if strategy is None:
    strategy = tf.distribute.get_strategy()
  if not is_multi_worker(strategy):
    return np.array([own], np.float64).reshape(1, len(own))
  workers = strategy.extended._num_workers  # pylint: disable=protected-access
  local = len(strategy.extended.worker_devices)

  # An all-gather made of one SUM all-reduce: worker w's first replica puts
  # its values in row w, every other entry is 0, so each entry has exactly
  # one non-zero addend and comes back exact. (Strategy.gather would retrace
  # a tf.function on every call; SUM is the only exact reduction TF offers.)
  def value_fn(ctx):
    rows = np.zeros((workers, len(own)), np.float64)
    if ctx.replica_id_in_sync_group % local == 0:
      rows[ctx.replica_id_in_sync_group // local] = own
    return tf.constant(rows)

  per_replica = strategy.experimental_distribute_values_from_function(value_fn)
  return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()


def agree(value: float, op: str = "max", strategy: Any = None) -> float:
  """One tiny all-reduce: the `op` of every worker's `value`, the same on every worker.

  Every worker must call it at the same point of the program, as any collective.

  Args:
    value: this worker's number (integers up to 2**53 come back exact).
    op: `max`, `min` or `sum`.
    strategy: the multi-worker strategy; None: the one in scope.

  Returns:
    The agreed number; `value` itself when there is no multi-worker strategy.

  Raises:
    ConfigError: an unknown `op`.
  """
  if op not in OPS:
    raise errors.ConfigError(f"Unknown op {op!r}; choose one of {', '.join(OPS)}.")
  column = gather([value], strategy)[:, 0]
  return float({"max": column.max, "min": column.min, "sum": column.sum}[op]())


# Bytes per number in gather_text: 48-bit words come back exact in float64.
_TEXT_WORD = 6


def gather_text(text: str, nbytes: int, strategy: Any = None) -> list[str]:
  """Every worker's `text`, in worker order, the same on every worker (one `gather`).

  Every worker must call it at the same point of the program with the same
  `nbytes`, as any collective.

  Args:
    text: this worker's string; its UTF-8 encoding has at most `nbytes` bytes.
    nbytes: the longest encoding any worker sends (agree on it first).
    strategy: the multi-worker strategy; None: the one in scope.

  Returns:
    One string per worker (one, this worker's, without a multi-worker strategy).
  """
  words = -(-nbytes // _TEXT_WORD)
  raw = text.encode("utf-8").ljust(words * _TEXT_WORD, b"\0")
  own = [int.from_bytes(raw[i:i + _TEXT_WORD], "big") for i in range(0, len(raw), _TEXT_WORD)]
  rows = gather(own, strategy)
  return [b"".join(int(w).to_bytes(_TEXT_WORD, "big") for w in row).rstrip(b"\0").decode("utf-8")
          for row in rows]


def shared_secret(me: Worker, nbytes: int = 32) -> bytes:
  """A random key the chief draws and every worker of the job gets, over the job's own collectives.

  One `gather`: the chief contributes random 32-bit words, the others
  zeros, and every worker takes the chief's row. It travels only where the
  job's collectives do (TensorFlow's runtime trusts that network) and is
  never written to disk; the local tier's side channel authenticates its
  connections with it (tfdp.checkpoint.local.wire). Every worker must call it at
  the same point of the program, as any collective.

  Args:
    me: this worker (with its strategy when there are several).
    nbytes: the key's length, a multiple of 4.

  Returns:
    `nbytes` bytes, the same on every worker.
  """
  words = nbytes // 4
  own = ([int.from_bytes(secrets.token_bytes(4), "big") for _ in range(words)]
         if me.is_chief else [0] * words)
  if me.count == 1:
    return b"".join(w.to_bytes(4, "big") for w in own)
  chief = gather(own, me.strategy)[0]
  return b"".join(int(w).to_bytes(4, "big") for w in chief)
