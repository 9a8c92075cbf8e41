"""Seconds a local restore and a peer recovery spend in each of their phases, summed per phase.

The restore path adds each phase's time here as it runs (a few clock reads
per tensor at most); `scripts/bench_tiers.py` takes them after a restore,
so the docs can say where the time goes, measured. The phases:

- `held`, `agree`: listing this worker's copies; the all-reduces of the
  agreement (tfdp.checkpoint.recovery).
- `map`, `check`, `views`: mapping the slot (faulted in at once), every
  tensor's CRC32C, the arrays that view it (tfdp.checkpoint.local.slots.read).
- `plan`, `tensors`, `assign`: matching the copy's keys with the objects,
  making TF tensors of the arrays (TF copies the bytes into new memory), and
  each object's `_restore_from_tensors` (tfdp.checkpoint.format.items).
- `index`, `before_restore`, `per_worker`: the TF index over the slot, the
  caller's checks, this worker's own per-worker state.
- Peer recovery: `allocate` (the receiving slot), `recv` and `land_check`
  (the bytes landing, their CRC32C as they land; on the side channel's
  thread), `wait` (the restore waiting for the copy, the two above inside
  it), `commit` (the received copy made this worker's own), `send` (a
  holder sending).
"""

import collections
import contextlib
import threading
import time

_seconds = collections.defaultdict(float)
_lock = threading.Lock()


def add(phase: str, seconds: float) -> None:
  """Adds `seconds` to `phase`."""
  with _lock:
    _seconds[phase] += seconds


@contextlib.contextmanager
def timed(phase: str):
  """Adds the time of the `with` block to `phase`."""
  start = time.perf_counter()
  try:
    yield
  finally:
    add(phase, time.perf_counter() - start)


def take() -> dict:
  """{phase: seconds} since the last `take`, then starts over."""
  with _lock:
    out = dict(_seconds)
    _seconds.clear()
  return out
