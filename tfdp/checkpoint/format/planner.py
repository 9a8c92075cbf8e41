"""Which worker writes which tensors into which files: a pure, byte-balanced save plan."""

from collections.abc import Mapping, Sequence
import dataclasses
import os

from tensorflow.python.trackable import base as trackable_base

OBJECT_GRAPH_KEY = trackable_base.OBJECT_GRAPH_PROTO_KEY
# A worker writes its part as up to this many files at once when each gets at
# least PARALLEL_MIN_FILE_BYTES: TF's BundleWriter copies and checksums on one
# core, so parallel files keep the disk, not one core, the limit.
PARALLEL_FILES = min(4, os.cpu_count() or 1)
PARALLEL_MIN_FILE_BYTES = 64 << 20


@dataclasses.dataclass
class Item:
  """One tensor (or slice) of the state as it will be written."""
  key: str
  slice_spec: str
  value: object  # tf.Tensor, or np.ndarray once snapshotted.
  nbytes: int | None  # None: not measured (a local copy's writer measures each tensor itself).


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """The files each worker writes: `files[worker][j]` lists file j's Items."""
  files: tuple[tuple[tuple[Item, ...], ...], ...]

  @property
  def num_workers(self) -> int:
    return len(self.files)

  def for_worker(self, worker: int) -> list[list[Item]]:
    return [list(f) for f in self.files[worker]]


def balance(items: Sequence[Item], n: int) -> list[list[Item]]:
  """Splits Items into `n` groups of about equal bytes (largest first onto the lightest).

  Deterministic given the same items, so every worker computes the same
  plan without talking to the others. The object graph goes to group 0.
  """
  groups = [[] for _ in range(n)]
  load = [0] * n
  for it in sorted(items, key=lambda it: (-it.nbytes, it.key, it.slice_spec)):
    w = 0 if it.key == OBJECT_GRAPH_KEY else min(range(n), key=lambda i: (load[i], i))
    groups[w].append(it)
    load[w] += it.nbytes
  for g in groups:
    g.sort(key=lambda it: (it.key, it.slice_spec))
  return groups


def split_files(items: Sequence[Item], max_bytes: int | None) -> list[list[Item]]:
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


def split_for_parallel_write(items: Sequence[Item]) -> list[list[Item]]:
  """Splits one worker's Items into files of about equal bytes to write at once."""
  total = sum(it.nbytes for it in items)
  n = max(1, min(PARALLEL_FILES, total // PARALLEL_MIN_FILE_BYTES, len(items)))
  return [f for f in balance(items, n) if f]


def plan_save(items: Sequence[Item], num_workers: int, *,
              max_shard_bytes: int | None = None,
              local_items: Mapping[int, Sequence[Item]] | None = None) -> SavePlan:
  """Plans one save: the shared state balanced by bytes over the workers.

  Args:
    items: the state every worker holds (identical on every worker).
    num_workers: how many workers write.
    max_shard_bytes: cap on each file (a bigger tensor still gets its own);
      without it, a worker's part is split for parallel writes.
    local_items: worker -> Items only that worker holds (per-worker state),
      added to its own part.

  Returns:
    The SavePlan (a worker gets no file when it got no tensor).
  """
  parts = balance(items, num_workers)
  for w, extra in (local_items or {}).items():
    parts[w] = parts[w] + list(extra)
  split = ((lambda p: split_files(p, max_shard_bytes)) if max_shard_bytes
           else split_for_parallel_write)
  return SavePlan(tuple(tuple(tuple(f) for f in split(p)) for p in parts))
