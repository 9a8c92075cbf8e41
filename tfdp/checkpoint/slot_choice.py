"""Which of a worker's local slots a copy may fill: a save's, or one a peer sends at a restore.

A worker's local copies live in slots (tfdp.checkpoint.slots): a copy
fills one whole, and its record, written last, commits it. Filling a slot
destroys the copy in it (its record is deleted first), so the choice of
the slot decides what a worker still holds if the fill never ends.
"""

from tfdp.checkpoint import copies
from tfdp.checkpoint import generations as generations_lib
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import slots as slots_lib


def held(layout: layout_lib.Layout, by_step: dict) -> tuple[dict, int | None]:
  """({slot: the step of the copy in it}, a slot no copy is in, or None) of `by_step` ({step: manifest})."""
  by_slot = {copies.slot_index(layout, m): s for s, m in by_step.items()}
  return by_slot, next((k for k in range(slots_lib.COUNT) if k not in by_slot), None)


def for_save(by_slot: dict, free: int | None, generations: generations_lib.Generations,
             wait_s: float) -> tuple[int, int | None] | None:
  """(the slot a save fills, the step of the copy in it, None if none); None: no slot may be filled now.

  Never the newest copy's. The other's copy is let go only once a newer
  step is complete on every worker: while it is the newest complete step,
  or newer than it (or none is complete yet: a fresh start, reports
  late), it is the step, or may become the step, that a replaced host
  finds held whole. Then this waits up to `wait_s` for a newer one to be
  complete (the writer thread waits, never training), else None.
  """
  if free is not None:
    return free, None
  newest = max(by_slot.values())
  k, older = next((k, s) for k, s in by_slot.items() if s != newest)
  if not generations.wait_past(older, wait_s):
    return None
  return k, older


def for_incoming(by_slot: dict, free: int | None, keep: int | None) -> tuple[int, int | None]:
  """(the slot a copy a peer sends lands in, the step of the copy in it, None if none).

  The slot of no copy, else the slot of a copy other than `keep` (the step
  a restore falls back to if this transfer fails: the newest step older
  than the one sent that every worker holds), the older when neither is.
  """
  if free is not None:
    return free, None
  k = min(by_slot, key=lambda k: (by_slot[k] == keep, by_slot[k]))
  return k, by_slot[k]
