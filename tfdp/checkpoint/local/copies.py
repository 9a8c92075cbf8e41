"""One local-tier copy on disk: how it is written and committed, checked, sent, received, restored and deleted.

The seam of the local tier's format. A copy is the whole state of one
worker at one step: its tensors' bytes in one of the worker's slot files
(tfdp.checkpoint.local.slots), committed by its typed manifest (the same record
and the same commit point as a persistent checkpoint:
tfdp.checkpoint.format.commit.commit) at `<local dir>/<name>-<step>`, written
last. The record lists every tensor (key, dtype, shape, offset, size,
CRC32C) and the copy's sequence number. No TensorFlow writer is involved;
when TensorFlow must read a copy (a restore's checks of the run config),
`readable` gives it a TF index over the slot (tfdp.checkpoint.local.bundle).
"""

import dataclasses
import os
import time

from absl import logging
import numpy as np

from tfdp import errors
from tfdp.checkpoint.local import bundle
from tfdp.checkpoint.format import directory
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import slot_file
from tfdp.checkpoint.local import phases as phases_lib
from tfdp.checkpoint.local import slots
from tfdp.checkpoint.format import commit as commit_lib
from tfdp.checkpoint.local import wire


def _whole(items):
  """`items`, when each is a whole tensor (the local tier holds no slices)."""
  for it in items:
    if it.slice_spec:
      raise errors.CheckpointError(
          f"{it.key} is a slice of a partitioned variable: the local tier holds whole "
          "tensors only. Save it with the persistent tier (local_checkpoint_every_steps=None).")
  return items


def write(slot: slots.Slot, prefix: str, items, base: manifest_lib.Manifest,
          sequence: int) -> manifest_lib.Manifest:
  """Fills `slot` with `items` and commits it as copy `prefix`: the record last.

  The caller has made sure no record names `slot` any more. A fill cut
  short leaves a slot no record names.

  Args:
    slot: the slot to fill (never the one of the newest committed copy).
    prefix: the copy's prefix.
    items: its Items (snapshots; variants become bytes here). Emptied once
      their bytes are in the slot, so the aliases of the variables go (the
      next update then copies nothing).
    base: the manifest's fields known before the write (what, whose).
    sequence: this worker's count of copies (the newest record of a slot wins).

  Returns:
    The committed manifest.
  """
  entries, used = slot.fill(_whole(items))
  items.clear()
  return _commit(slot, prefix, base, entries, used, sequence)


def _commit(slot, prefix, base, entries, used, sequence):
  record = manifest_lib.FileRecord(os.path.basename(slot.path), used, entries=entries)
  man = dataclasses.replace(base, prefix=os.path.basename(prefix), time=time.time(),
                            files=[record], num_shards=1, total_bytes=used,
                            state_bytes=sum(entries.sizes), sequence=sequence)
  return commit_lib.commit(prefix, man)


def slot_index(layout: layout_lib.Layout, man: manifest_lib.Manifest) -> int | None:
  """Which of `layout`'s slots copy `man` lives in (None: not a copy in a slot of this layout)."""
  record = man.slot
  names = [os.path.basename(layout.slot(k)) for k in range(slots.COUNT)]
  return names.index(record.name) if record is not None and record.name in names else None


def check(layout: layout_lib.Layout, prefix: str, man: manifest_lib.Manifest) -> None:
  """Checks that copy `prefix` names one of this worker's slots, well formed, and that it is big enough; reads none of it.

  Raises:
    CorruptCheckpointError: naming what is wrong.
  """
  k = slot_index(layout, man)
  if k is None:
    raise errors.CorruptCheckpointError(f"{prefix}: not a copy in a slot of {layout.directory}")
  try:
    slot_file.check_entries(man.slot.entries, man.slot.size)
  except ValueError as e:
    raise errors.CorruptCheckpointError(f"{prefix}: its record is malformed: {e}") from None
  path = layout.slot(k)
  have = os.path.getsize(path) if os.path.exists(path) else -1
  if have < man.slot.size:
    raise errors.CorruptCheckpointError(
        f"{path}: {max(have, 0)} bytes, copy {os.path.basename(prefix)} needs {man.slot.size} "
        "(truncated or missing)")


def readable(layout: layout_lib.Layout, prefix: str, man: manifest_lib.Manifest) -> None:
  """Gives copy `prefix` a TF index over its slot, so `tf.train.load_checkpoint(prefix)` reads it."""
  bundle.write(prefix, layout.slot(slot_index(layout, man)), man.slot.entries)


def restore(checkpoint, layout: layout_lib.Layout, prefix: str, man: manifest_lib.Manifest,
            applying=None, received: bool = False, times=None) -> dict:
  """Restores copy `prefix` into `checkpoint`: maps its slot, checks every CRC32C, then assigns.

  Nothing is assigned unless every tensor's bytes match. When the slot's
  tensors are exactly what `checkpoint` holds now, each object gets its
  values straight from the mapping; otherwise (objects made later, another
  structure) TensorFlow's own restore reads the copy through a TF index,
  as it would a checkpoint of its own.

  Args:
    checkpoint: the `tf.train.Checkpoint`.
    layout: this worker's local layout.
    prefix: the copy.
    man: its manifest (checked by `check`).
    applying: called once the bytes are checked, before anything is assigned.
    received: the copy was received by this process a moment ago (`Incoming.receive`
      checked every tensor's CRC32C as its bytes landed in the slot, and
      nothing wrote the slot since): its bytes are not checked again.
    times: the restore's PhaseTimes (tfdp.checkpoint.local.phases), or None.

  Returns:
    {key: value} of every tensor of the copy (arrays viewing the mapping).

  Raises:
    CorruptCheckpointError: naming the first tensor whose bytes do not match.
  """
  check(layout, prefix, man)
  tensors = slot_file.read(layout.slot(slot_index(layout, man)), man.slot.entries,
                           man.slot.size, checked=received, times=times)
  if applying is not None:
    applying()
  root = layout_lib.PER_WORKER_ROOT + "/"
  shared = {k: v for k, v in tensors.items() if not k.startswith(root)}
  if not items_lib.restore_values(checkpoint, shared, times=times):
    logging.info("tfdp: %s does not hold exactly this checkpoint's objects; TensorFlow "
                 "restores it.", prefix)
    readable(layout, prefix, man)
    checkpoint.restore(prefix)
  return tensors


def send(layout: layout_lib.Layout, held_manifest: manifest_lib.Manifest) -> tuple[str, int]:
  """(the slot file, the bytes of it) that a holder sends of a copy."""
  return layout.slot(slot_index(layout, held_manifest)), held_manifest.slot.size


@dataclasses.dataclass
class Incoming:
  """A copy a peer offers, checked: its manifest, where its bytes land, and the seconds they took."""
  manifest: manifest_lib.Manifest
  slot: slots.Slot | None
  size: int
  # `allocate`, `recv`, `land_behind`, `land_check`, `land_write`, `land_tail` (on the side
  # channel's threads): the restore adds them to its own.
  times: phases_lib.PhaseTimes = dataclasses.field(default_factory=phases_lib.PhaseTimes)

  def receive(self, conn) -> None:
    """Receives the copy's bytes from `conn` into the slot, checking each tensor's CRC32C as it lands.

    Args:
      conn: the side channel's Channel (its frame's MAC is fed where the
        CRC32Cs are checked, off the receiving thread), or a plain socket.

    Raises:
      ConnectionError: the sender stopped in the middle.
      wire.Refused: a tensor's bytes do not match the offered record.
    """
    with self.times.timed("allocate"):  # Mapped; allocated as the bytes land (Slot.receivable).
      dst, allocate = self.slot.receivable(self.size)
    reader = getattr(conn, "blob_reader", None)
    recv_into, digest = reader() if reader is not None else (conn.recv_into, None)
    try:
      # Written to the slot's file, not through its mapping: the page cache
      # takes them without a page fault or a zeroed page each.
      slot_file.receive(recv_into, dst, self.manifest.slot.entries, self.slot.path, self.times,
                        digest, allocate)
    except ValueError as e:
      raise wire.Refused(f"a copy whose bytes do not match its record: {e}", "crc") from None


def incoming(layout: layout_lib.Layout, slot: slots.Slot | None, step: int, manifest_json: str,
             sizes: list[int]) -> Incoming:
  """Checks a copy of `step` that a peer offers; its bytes go to `slot` (a path from the layout and integers only).

  `slot` may be set on the result after the check (the receiver picks it).

  Raises:
    wire.Refused: the offer is not a well-formed local copy of `step` of those bytes.
  """
  try:
    man = manifest_lib.Manifest.from_json(manifest_json)
    record = man.slot
    ok = (man.tier == "local" and man.step == step and isinstance(man.prefix, str)
          and man.prefix == os.path.basename(layout.prefix(step)) and record is not None
          and isinstance(record.size, int) and [record.size] == list(sizes))
    if ok:
      slot_file.check_entries(record.entries, record.size)
  except Exception as e:  # pylint: disable=broad-except
    raise wire.Refused(f"a copy whose manifest does not parse: {e}", "manifest") from None
  if not ok:
    raise wire.Refused(f"a copy of step {step} whose manifest does not describe it", "manifest")
  return Incoming(man, slot, record.size)


def adopt(slot: slots.Slot, prefix: str, offered: Incoming, own, base: manifest_lib.Manifest,
          worker: int, sequence: int) -> manifest_lib.Manifest:
  """Makes a copy a peer sent (its bytes received into `slot`) this worker's copy `prefix`.

  Args:
    slot: the slot the bytes landed in.
    prefix: the copy's prefix.
    offered: the sender's offer, received.
    own: this worker's own per-worker Items (kept by its neighbour), or None:
      appended after the received bytes, as a save would have held them.
    base: this worker's fields of the manifest (session, writers, world size).
    worker: this worker's index.
    sequence: this worker's count of copies.

  Returns:
    The committed manifest.
  """
  entries, used = offered.manifest.slot.entries, offered.size
  root = layout_lib.per_worker_prefix(worker)
  holds_own = any(k.startswith(root) for k in entries.keys)
  if own and not holds_own:  # A copy that came from this worker holds its state already.
    more, used = slot.fill(_whole(own), start=used)
    entries = entries + more
  man = dataclasses.replace(offered.manifest, session=base.session, world_size=base.world_size,
                            writers={str(worker): {"files": 1}},
                            per_worker_required=bool(own) or holds_own)
  return _commit(slot, prefix, man, entries, used, sequence)


def committed(layout: layout_lib.Layout) -> list[int]:
  """The steps of the copies in `layout`'s folder with a manifest."""
  return [layout_lib.number_of(p) for p in directory.committed(layout)]


def per_worker_reader(tensors: dict):
  """A reader of a restored copy's tensors with TF's checkpoint reader's `has_tensor`/`get_tensor`."""
  return _Reader(tensors)


class _Reader:

  def __init__(self, tensors):
    self._tensors = tensors

  def has_tensor(self, key: str) -> bool:
    return key in self._tensors

  def get_tensor(self, key: str):
    value = self._tensors[key]
    return np.array(value) if isinstance(value, np.ndarray) else value

