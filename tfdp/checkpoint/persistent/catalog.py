"""The managed checkpoints of a directory (tfdp's and TF's own) as tf.train.CheckpointManager sees them, and TF's state file."""

import dataclasses
import os
import threading
import time

from absl import logging
from tensorflow.python.checkpoint import checkpoint_management

from tfdp import errors
from tfdp.checkpoint.format import directory as directory_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.persistent import retention


@dataclasses.dataclass
class Catalog:
  """The checkpoints of one directory as tf.train.CheckpointManager sees them (thread-safe).

  Attributes:
    managed: the managed checkpoints, oldest first (what `checkpoints` lists).
    latest: the newest checkpoint's prefix (managed or not), or None.
    last_preserved: TF's `last_preserved_timestamp` (hours retention).
    manifests: basename -> Manifest of the tfdp checkpoints among them.
    unknown: prefixes of checkpoints neither TF's state file nor a tfdp
      manifest accounts for (kept; see `read`).
  """
  managed: list[retention.Entry]
  latest: str | None
  last_preserved: float
  manifests: dict[str, manifest_lib.Manifest]
  unknown: list[str] = dataclasses.field(default_factory=list)
  # Committed checkpoints a restore could not read (a transient error): out
  # of the managed ones for this session, and a new save may replace them.
  abandoned: set[str] = dataclasses.field(default_factory=set)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                            compare=False)

  def prefixes(self) -> list[str]:
    """Prefixes of the managed checkpoints, oldest first."""
    with self._lock:
      return [e.prefix for e in self.managed]

  def newest(self) -> str | None:
    with self._lock:
      return self.latest

  def candidates(self) -> list[str]:
    """Prefixes to restore from, newest first."""
    with self._lock:
      prefixes = {e.prefix for e in self.managed}
      if self.latest is not None:
        prefixes.add(self.latest)
    return sorted(prefixes, key=number_of, reverse=True)

  def manifest(self, prefix: str) -> manifest_lib.Manifest | None:
    """The manifest of `prefix` (read from disk when not known yet), or None (TF's own)."""
    with self._lock:
      man = self.manifests.get(os.path.basename(prefix))
    return man if man is not None else manifest_lib.read_manifest(prefix)

  def drop(self, prefix: str):
    """Takes `prefix` out; returns the newest left (or None), or False when it was not a candidate."""
    if prefix not in self.candidates():
      return False
    with self._lock:
      self.managed = [e for e in self.managed if e.prefix != prefix]
      self.manifests.pop(os.path.basename(prefix), None)
      if self.latest == prefix:
        self.latest = self.managed[-1].prefix if self.managed else None
      return self.latest

  def abandon(self, prefix: str) -> None:
    """Takes `prefix` out (see `drop`) without touching its files: a later save may replace it."""
    self.drop(prefix)
    with self._lock:
      self.abandoned.add(prefix)

  def check_new(self, prefix: str) -> None:
    """Raises CheckpointError unless a new checkpoint may be committed at `prefix`."""
    with self._lock:
      abandoned = prefix in self.abandoned
    if not abandoned and fs.exists(layout_lib.manifest_path(prefix)):
      raise errors.CheckpointError(
          f"Checkpoint {prefix} already exists; it is not overwritten. Save "
          "under another number, or train into a new directory (a save of the "
          "step it holds returns it when the manager has a step_counter).")
    latest = self.newest()
    if latest is not None and layout_lib.number_of(prefix) < number_of(latest):
      # Retention and latest_checkpoint go by number: a lower one would be
      # dropped as the oldest at once, and a restart would resume the other.
      raise errors.CheckpointError(
          f"Checkpoint {prefix} would be older than {os.path.basename(latest)}, "
          f"already in {os.path.dirname(prefix)}. Restore the newest checkpoint "
          "before training on (restore_or_initialize()), train into a new "
          "directory, or delete the newer checkpoints to roll back.")

  def check_nothing_unknown(self) -> None:
    """Raises CheckpointError when the directory holds checkpoints nothing accounts for.

    Called when nothing could be restored: starting over next to them could
    silently throw away a run.
    """
    if self.unknown:
      names = ", ".join(os.path.basename(p) for p in self.unknown[-3:])
      raise errors.CheckpointError(
          f"{os.path.dirname(self.unknown[0])} holds checkpoints ({names}) that neither TF's "
          "`checkpoint` state file nor a tfdp manifest names, and nothing else to "
          "resume from: restore one yourself (manager.restore(path)), or move them "
          "away to start over.")

  def plan(self, prefix: str, number: int, metrics: dict, keep: retention.KeepPolicy,
           hours: retention.KeepEveryNHours) -> retention.Sweep:
    """What to keep once checkpoint `prefix` commits: decided before it is written."""
    new = retention.Entry(prefix, number, time.time(), metrics)
    with self._lock:
      entries = [e for e in self.managed if e.prefix != prefix] + [new]
      last_preserved = self.last_preserved
    return retention.sweep(entries, keep, hours, last_preserved)

  def commit(self, man: manifest_lib.Manifest, prefix: str, sweep: retention.Sweep) -> None:
    """Records committed checkpoint `prefix` and the retention decided for it (`plan`)."""
    kept = set(man.kept or [man.prefix])
    new = retention.Entry(prefix, man.checkpoint_number, man.time, man.metrics)
    managed = [new if e.prefix == prefix else e for e in sweep.kept]
    with self._lock:
      self.managed = [e for e in managed if os.path.basename(e.prefix) in kept]
      self.latest = prefix
      self.last_preserved = sweep.last_preserved
      self.manifests[man.prefix] = man
      for e in sweep.preserved + sweep.deleted:
        self.manifests.pop(os.path.basename(e.prefix), None)


def _state(directory):
  try:
    return directory_lib.read_state(directory)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("tfdp: ignoring the unreadable checkpoint state file of %s: %s",
                    directory, e)
    return None


def number_of(prefix: str) -> int:
  """The number of checkpoint `prefix` (`name-<n>`); -1 for a name TF wrote without one."""
  try:
    return layout_lib.number_of(prefix)
  except (IndexError, ValueError):
    return -1


def read(layout: layout_lib.Layout, now: float) -> Catalog:
  """Reads the checkpoints of `layout`'s directory, with TF's rules for its state file.

  As tf.train.CheckpointManager: the newest checkpoint TF's `checkpoint`
  file names is the latest, whatever its name (e.g. one
  `tf.train.Checkpoint.save` wrote, or a manager with another
  `checkpoint_name`), and a listed one is managed (kept and deleted by
  retention) when newer than the last preserved one; the others stay. A
  tfdp checkpoint of this name not listed (a crash between the commit and
  the state file) is managed when newer too; with no state file, every tfdp
  checkpoint of this name is. Checkpoints none of this covers are
  `unknown`: kept, never deleted, and a restore that finds nothing else
  refuses to start over next to them.
  """
  found = directory_lib.scan(layout_lib.Layout(layout.directory, None))  # Every name.
  usable = {b for b, kinds in found.items()
            if "manifest" in kinds or ("index" in kinds and "corrupt" not in kinds)}
  manifests = {}
  for base in sorted(usable):
    if "manifest" in found[base]:
      man = manifest_lib.read_manifest(os.path.join(layout.directory, base))
      if man is not None:
        manifests[base] = man
  ours = {b: m for b, m in manifests.items() if layout.is_checkpoint(b)}
  state = _state(layout.directory)
  entries, latest = {}, None
  if state is None:
    last_preserved = now - 1.0
    for base, man in ours.items():
      entries[base] = man.time
  else:
    last_preserved = min(state.last_preserved, now)
    paths = list(state.paths)
    stamps = list(state.timestamps) or [last_preserved] * len(paths)
    for path, stamp in zip(paths, stamps):
      base = os.path.basename(path)
      if base in usable:
        stamp = manifests[base].time if base in manifests else min(stamp, now)
        if stamp > last_preserved:
          entries[base] = stamp
    for base, man in ours.items():
      if base not in entries and man.time > last_preserved:
        entries[base] = man.time
    base = os.path.basename(state.latest)
    if base in usable:
      latest = os.path.join(layout.directory, base)
  managed = sorted(
      (retention.Entry(os.path.join(layout.directory, b), number_of(b), t,
                       manifests[b].metrics if b in manifests else {})
       for b, t in entries.items()), key=lambda e: e.number)
  if managed and (latest is None or managed[-1].number > number_of(latest)):
    latest = managed[-1].prefix
  known = set(entries) | set(manifests) | {os.path.basename(latest or "")}
  unknown = sorted((b for b in usable if b not in known), key=number_of)
  return Catalog(managed, latest, last_preserved, manifests,
                 [os.path.join(layout.directory, b) for b in unknown])


def write_state(layout: layout_lib.Layout, catalog: Catalog) -> None:
  """Writes TF's `checkpoint` file, so tf.train.latest_checkpoint and TF's manager agree."""
  with catalog._lock:  # pylint: disable=protected-access
    latest, managed = catalog.latest, list(catalog.managed)
    last_preserved = catalog.last_preserved
  if latest is None:
    if fs.exists(layout.state_path):
      fs.remove(layout.state_path)
    return
  checkpoint_management.update_checkpoint_state_internal(
      save_dir=layout.directory, model_checkpoint_path=latest,
      all_model_checkpoint_paths=[e.prefix for e in managed],
      all_model_checkpoint_timestamps=[e.time for e in managed],
      last_preserved_timestamp=last_preserved, save_relative_paths=True)
