"""One local-tier copy on disk: how it is written and committed, checked, sent, received, restored and deleted.

The seam of the local tier's format. A copy is the whole state of one
worker at one step under `<local dir>/<name>-<step>`, committed by its
typed manifest (tfdp.checkpoint.manifest.Manifest, the same record and the
same commit point as a persistent checkpoint: tfdp.checkpoint.storage.commit),
written last. Today its bytes are a TF checkpoint of one data file; the
local tier (tfdp.checkpoint.local) and peer recovery
(tfdp.checkpoint.recovery) use only the functions here, so another format
can replace it behind them.
"""

import dataclasses
import os
import time

from tfdp.checkpoint import catalog
from tfdp.checkpoint import faults
from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import planner
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import storage
from tfdp.checkpoint import wire


def write(prefix: str, items: list[planner.Item], base: manifest_lib.Manifest,
          worker: int) -> manifest_lib.Manifest:
  """Writes copy `prefix` of `items` and commits it: its files straight under the final name, the manifest last.

  No temp dir, no markers, no merge. A torn write leaves files without a
  manifest, which `cleanup` removes.

  Args:
    prefix: the copy's prefix.
    items: its Items (snapshots; variants become bytes here).
    base: the manifest's fields known before the write (what, whose).
    worker: the writer's index in the job (named to fault hooks).

  Returns:
    The committed manifest.
  """
  faults.reached("before_shard", worker)
  nbytes = storage.write_shard(prefix, items)
  for phase in ("after_shard", "after_marker"):  # One writer: no marker to wait for.
    faults.reached(phase, worker)
  files = storage.seal(prefix, [[it.key for it in items]])
  man = dataclasses.replace(base, prefix=os.path.basename(prefix), time=time.time(), files=files,
                            num_shards=1, total_bytes=sum(f.size for f in files),
                            state_bytes=sum(nbytes))
  return storage.commit(prefix, man, worker)


def files(prefix: str, man: manifest_lib.Manifest) -> list[str]:
  """The files of copy `prefix` that a holder sends, in its manifest's order."""
  folder = os.path.dirname(prefix)
  return [os.path.join(folder, f.name) for f in man.files]


def check(prefix: str, man: manifest_lib.Manifest) -> None:
  """Checks that every file of the copy is there with its size, reading none of it.

  Raises:
    CorruptCheckpointError: naming the file.
  """
  restore_lib.check_sizes(prefix, man)


def restore(checkpoint, prefix: str, man: manifest_lib.Manifest) -> None:
  """Restores copy `prefix` into `checkpoint` (TF checks every tensor's CRC32C as it reads)."""
  restore_lib.restore_verified(checkpoint, prefix, man)


def incoming(layout: layout_lib.Layout, step: int, manifest_json: str,
             sizes: list[int]) -> tuple[manifest_lib.Manifest, list[str]]:
  """Checks a copy of `step` that a peer offers; returns its manifest and where its files go.

  The paths come from `layout` and integers only, never from the offer.

  Raises:
    wire.Refused: the offer is not a local copy of `step` with those files.
  """
  try:
    man = manifest_lib.Manifest.from_json(manifest_json)
    n = len(man.files) - 1
    prefix = layout.prefix(step)
    names = [os.path.basename(layout_lib.index_path(prefix))] + [
        os.path.basename(layout_lib.data_filename(prefix, k, n)) for k in range(n)]
    ok = (man.tier == "local" and man.step == step and man.prefix == os.path.basename(prefix)
          and 1 <= n <= wire.MAX_FILES and [f.name for f in man.files] == names
          and [f.size for f in man.files] == list(sizes)
          and all(isinstance(f.tensors, list) for f in man.files[1:]))
  except Exception as e:  # pylint: disable=broad-except
    raise wire.Refused(f"a copy whose manifest does not parse: {e}", "manifest") from None
  if not ok:
    raise wire.Refused(f"a copy of step {step} whose manifest does not describe it", "manifest")
  dest = layout.received(step)
  return man, [layout_lib.index_path(dest)] + [
      layout_lib.data_filename(dest, k, n) for k in range(n)]


def adopt(layout: layout_lib.Layout, step: int, offered: manifest_lib.Manifest, own,
          base: manifest_lib.Manifest, worker: int) -> manifest_lib.Manifest:
  """Makes a copy a peer sent (its files written by `incoming`'s paths) this worker's copy of `step`.

  Args:
    layout: this worker's local layout.
    step: the copy's step.
    offered: the sender's manifest (checked by `incoming`).
    own: this worker's own per-worker Items (kept by its neighbour), or None:
      written as a second part and merged in, as a save would have held them.
    base: this worker's fields of the manifest (session, writers, world size).
    worker: this worker's index.

  Returns:
    The committed manifest.
  """
  prefix, received = layout.prefix(step), layout.received(step)
  parts, keys = [received], [list(f.tensors) for f in offered.files[1:]]
  own_bytes = 0
  root = layout_lib.per_worker_prefix(worker)
  if any(k.startswith(root) for part in keys for k in part):
    own = None  # The copy holds this worker's state of that step already (it came from it).
  if own:
    own_bytes = sum(storage.write_shard(layout.received_own(step), own))
    parts.append(layout.received_own(step))
    keys.append([it.key for it in own])
  storage.merge(parts, prefix)
  files_ = storage.seal(prefix, keys)
  man = dataclasses.replace(
      offered, prefix=os.path.basename(prefix), time=time.time(), files=files_,
      num_shards=len(keys), total_bytes=sum(f.size for f in files_),
      state_bytes=offered.state_bytes + own_bytes, session=base.session,
      writers={str(worker): {"files": len(keys)}}, world_size=base.world_size,
      per_worker_required=bool(own) or any(k.startswith(root) for part in keys for k in part))
  storage.commit(prefix, man, worker)
  discard_incoming(layout, step)
  return man


def discard_incoming(layout: layout_lib.Layout, step: int) -> None:
  """Removes what a peer sent of a copy of `step` and what was written to merge it."""
  any_name = layout_lib.Layout(layout.directory, None)
  for part in (layout.received(step), layout.received_own(step)):
    for path in catalog.files_of(any_name, part):
      fs.remove(path)


def committed(layout: layout_lib.Layout) -> list[int]:
  """The steps of the copies in `layout`'s folder with a manifest."""
  return [layout_lib.number_of(p) for p in catalog.committed(layout)]


def delete(layout: layout_lib.Layout, prefix: str,
           man: manifest_lib.Manifest | None = None) -> None:
  """Deletes copy `prefix`: its manifest first, so a crash leaves no committed half.

  With its manifest, the files it names; without, what the folder holds of it.
  """
  rest = files(prefix, man) if man is not None else catalog.files_of(layout, prefix)
  for path in [layout_lib.manifest_path(prefix)] + rest:
    try:
      os.remove(path)
    except OSError:
      pass


def cleanup(layout: layout_lib.Layout, session: str) -> None:
  """Removes what torn local saves and cut-short transfers left: every file no manifest commits."""
  storage.cleanup(layout, session, private=True)
