"""Seconds a local restore and a peer recovery spend in each of their phases, summed per phase.

A restore makes one `PhaseTimes` (tfdp.checkpoint.recovery.TieredRestore)
and hands it down to what it calls, each adding its phases' time as it
runs (a few clock reads per tensor at most); `scripts/bench_tiers.py`
takes them after a restore, so the docs can say where the time goes,
measured. The phases:

- `held`, `agree`: listing this worker's copies; the all-reduces of the
  agreement (tfdp.checkpoint.recovery).
- `map`, `check`, `views`: mapping the slot (faulted in at once), every
  tensor's CRC32C, the arrays that view it (tfdp.checkpoint.format.slot_file.read).
- `plan`, `tensors`, `assign`: matching the copy's keys with the objects,
  making TF tensors of the arrays (TF copies the bytes into new memory), and
  each object's `_restore_from_tensors` (tfdp.checkpoint.format.items).
- `index`, `before_restore`, `per_worker`: the TF index over the slot, the
  caller's checks, this worker's own per-worker state.
- Peer recovery: `allocate` (the receiving thread allocating the slot,
  16 MB ahead of the bytes), `recv` (waiting for bytes), `land_behind`
  (waiting for a free buffer), `land_check` (the checking thread: each
  piece's CRC32C and the frame's MAC), `land_write` (the storing thread
  writing each piece to the slot's file), `land_tail` (from the last byte
  until all is checked and stored; all on the side channel's threads, kept
  by the copy received,
  tfdp.checkpoint.local.copies.Incoming, and added to the restore's),
  `wait` (the restore waiting for the copy, the ones above inside it),
  `commit` (the received copy made this worker's own), `send` (a holder
  sending).
"""

import collections
import contextlib
import threading
import time


class PhaseTimes:
  """{phase: seconds}, summed per phase; safe to add to from several threads."""

  def __init__(self):
    self._seconds = collections.defaultdict(float)
    self._lock = threading.Lock()

  def add(self, phase: str, seconds: float) -> None:
    """Adds `seconds` to `phase`."""
    with self._lock:
      self._seconds[phase] += seconds

  @contextlib.contextmanager
  def timed(self, phase: str):
    """Adds the time of the `with` block to `phase`."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(phase, time.perf_counter() - start)

  def merge(self, other: "PhaseTimes") -> None:
    """Adds every phase of `other` (what another thread timed)."""
    for phase, seconds in other.take().items():
      self.add(phase, seconds)

  def take(self) -> dict:
    """{phase: seconds} since the last `take`, then starts over."""
    with self._lock:
      out = dict(self._seconds)
      self._seconds.clear()
    return out
