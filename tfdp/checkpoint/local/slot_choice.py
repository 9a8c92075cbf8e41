"""Which of a worker's local slots a copy may fill: a save's, or one a peer sends at a restore.

A worker's local copies live in slots (tfdp.checkpoint.local.slots): a copy
fills one whole, and its record, written last, commits it. Filling a slot
destroys the copy in it (its record is deleted first), so the choice of
the slot decides what a worker still holds if the fill never ends.
"""

from tfdp.checkpoint.local import copies
from tfdp.checkpoint.local import generations as generations_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.local import slots as slots_lib


def held(layout: layout_lib.Layout, by_step: dict) -> tuple[dict, int | None]:
  """({slot: the step of the copy in it}, a slot no copy is in, or None) of `by_step` ({step: manifest})."""
  by_slot = {copies.slot_index(layout, m): s for s, m in by_step.items()}
  return by_slot, next((k for k in range(slots_lib.COUNT) if k not in by_slot), None)


def for_save(by_slot: dict, free: int | None, generations: generations_lib.Generations,
             timeout: float, stop) -> tuple[int, int | None] | None:
  """(the slot a save fills, the step of the copy in it, None if none); None: the save is skipped.

  Never the newest copy's, never the floor's (the newest step complete on
  every worker, what a replaced host finds held whole). With both slots
  full, the save (the writer thread, never training) waits until one may
  go (Generations.wait_free):
  - the older, once a newer step is complete: until then it is the floor,
    or may become it (a fresh start; reports late);
  - else the newest, once it can never be complete (a worker skipped it,
    or this worker's own part of it failed): it can never be the floor.
  One of the two always comes while the workers live and save: every
  worker's writer saves in order and reports in order, so of the worker
  whose newest copy is the oldest of all workers' newest, every other
  worker either reported that step (it is complete: its older copy may go)
  or reported a later one without it (it is dead). The wait ends early only
  when `stop()` says a worker is lost or the side channel closed, or after
  `timeout`: then the save is skipped, and the others see that at this
  worker's next report.
  """
  if free is not None:
    return free, None
  by_step = {s: k for k, s in by_slot.items()}
  newest = max(by_step)
  older = min(by_step)
  step = generations.wait_free(older, newest, timeout, stop)
  return None if step is None else (by_step[step], step)


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
