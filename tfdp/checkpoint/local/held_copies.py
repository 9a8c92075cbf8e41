"""What a worker's local directory holds: the copies found at start (the newest of each slot), why a copy cannot be used, and the peer recovery markers."""

import dataclasses
import os
import time

from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import commit as commit_lib
from tfdp.checkpoint.local import copies


@dataclasses.dataclass(frozen=True)
class Held:
  """One intact local copy of this worker."""
  step: int
  prefix: str
  manifest: manifest_lib.Manifest


def scan(layout) -> tuple[dict, int]:
  """The committed copies in `layout`'s directory, the newest record of each slot; the others are deleted.

  A record that is torn, or whose bytes are no slot's, is deleted; so are
  the older records of a slot filled again after them.

  Returns:
    (step -> manifest of each copy kept, the highest sequence number kept or 0).
  """
  found = {}
  for step in copies.committed(layout):
    man = manifest_lib.read_manifest(layout.prefix(step))
    k = None if man is None else copies.slot_index(layout, man)
    if k is None:
      commit_lib.delete(layout, layout.prefix(step))  # Torn, or not a slot copy.
      continue
    found.setdefault(k, []).append((man.sequence, step, man))
  kept, sequence = {}, 0
  for records in found.values():
    records.sort(key=lambda r: r[:2])
    for _, step, _ in records[:-1]:  # The slot was filled again after them.
      commit_lib.delete(layout, layout.prefix(step))
    sequence = max(sequence, records[-1][0])
    kept[records[-1][1]] = records[-1][2]
  return kept, sequence


def problem(layout, prefix: str, man, token: str, num_workers: int) -> str | None:
  """Why local copy `prefix` (record `man`, None: unreadable) cannot be restored by this run, or None.

  Its record is checked, and its slot's size (every tensor's CRC32C is
  checked when a copy is restored).
  """
  if man is None or man.tier != "local":
    return "no local-tier manifest"
  if man.run_token != token:
    return "of another run in this directory"
  if man.world_size != num_workers:
    return f"saved by a job of {man.world_size} workers, this one has {num_workers}"
  try:
    copies.check(layout, prefix, man)
  except errors.CorruptCheckpointError as e:
    return str(e)
  return None


def mark_recovery(layout, step: int) -> None:
  """Peer recovery markers: notes, before a peer recovery of `step` starts, that it is under way."""
  fs.write_json_atomic(layout.recovery_marker(step), {"step": step, "time": time.time()})


def clear_recovery(layout) -> None:
  """Removes the peer recovery markers (the recovery finished, or a restore made them moot)."""
  for step in layout.recovery_steps():
    try:
      os.remove(layout.recovery_marker(step))
    except OSError:
      pass
