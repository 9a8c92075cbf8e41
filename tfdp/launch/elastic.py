"""The elastic restart policy: which worker slots take part in the next attempt."""

import subprocess
from typing import Callable, Optional, Sequence

from tfdp.launch.exits import Failure


class Slots:
  """Which worker slots take part, under `--elastic`.

  A slot "keeps failing" when it was blamed for `slot_failures` attempts in
  a row (the worker that died, exited non-zero or hung first; a worker that
  only lost its peer is never blamed). Such a slot is left out of the next
  attempts while at least `min_workers` remain. Before every restart a
  left-out slot is checked again: with `slot_check`, it returns when that
  command exits 0; without, it returns after sitting out one attempt. A
  returning slot that is blamed once more is left out again at once.

  Without `--elastic` the launcher gives `min_workers=num_slots`, so no slot
  is ever left out.

  Args:
    num_slots: slots 0..num_slots-1, all active at first.
    min_workers: the fewest active slots.
    slot_failures: blamed attempts in a row that make a slot keep failing.
    slot_check: shell command formatted with {slot} and {host}, or None.
    hosts: the address of each slot, or None for localhost.
    log: where decisions are logged (one line each).
  """

  def __init__(self, num_slots: int, min_workers: int, slot_failures: int,
               slot_check: Optional[str], hosts: Optional[Sequence[str]],
               log: Callable[[str], None]):
    self.active = list(range(num_slots))
    self.dropped = {}  # slot -> attempts sat out
    self.streak = [0] * num_slots
    self.min_workers = min_workers
    self.slot_failures = slot_failures
    self.slot_check = slot_check
    self.hosts = hosts
    self.log = log

  def record(self, failure: Optional[Failure]) -> None:
    """Counts the attempt that just ended against the slot it blames, if any."""
    for s in self.active:
      if failure is None or s != failure.slot or failure.kind == "preempted":
        self.streak[s] = 0
    if failure is None or failure.kind == "preempted":
      return
    self.streak[failure.slot] += 1
    if (self.streak[failure.slot] >= self.slot_failures
        and len(self.active) > self.min_workers):
      self.active.remove(failure.slot)
      self.dropped[failure.slot] = 0
      self.log(f"slot {failure.slot} failed {self.streak[failure.slot]} attempts in a "
               f"row; leaving it out ({len(self.active)} workers).")

  def _healthy(self, slot):
    if not self.slot_check:
      return self.dropped[slot] >= 1
    host = self.hosts[slot] if self.hosts else "localhost"
    cmd = self.slot_check.format(slot=slot, host=host)
    try:
      return subprocess.run(cmd, shell=True, timeout=30, check=False,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode == 0
    except subprocess.TimeoutExpired:
      return False

  def before_attempt(self) -> None:
    """Takes back every left-out slot that is healthy again."""
    for slot in sorted(self.dropped):
      if self._healthy(slot):
        del self.dropped[slot]
        self.active.append(slot)
        self.active.sort()
        self.streak[slot] = self.slot_failures - 1
        self.log(f"slot {slot} is back; using {len(self.active)} workers.")

  def after_attempt(self) -> None:
    """Counts one more attempt sat out for every left-out slot."""
    for slot in self.dropped:
      self.dropped[slot] += 1
