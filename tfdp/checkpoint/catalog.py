"""What a checkpoint directory holds: the managed checkpoints (tfdp's and TF's own) and TF's state file."""

import dataclasses
import os

from absl import logging
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import retention


@dataclasses.dataclass
class Catalog:
  """The checkpoints of one directory as tf.train.CheckpointManager sees them.

  Attributes:
    managed: the managed checkpoints, oldest first (what `checkpoints` lists).
    latest: the newest checkpoint's prefix (managed or not), or None.
    last_preserved: TF's `last_preserved_timestamp` (hours retention).
    manifests: basename -> Manifest of the tfdp checkpoints among them.
  """
  managed: list[retention.Entry]
  latest: str | None
  last_preserved: float
  manifests: dict[str, manifest_lib.Manifest]

  def candidates(self) -> list[str]:
    """Prefixes to restore from, newest first."""
    prefixes = {e.prefix for e in self.managed}
    if self.latest is not None:
      prefixes.add(self.latest)
    return sorted(prefixes, key=layout_lib.number_of, reverse=True)

  def drop(self, prefix: str) -> None:
    self.managed = [e for e in self.managed if e.prefix != prefix]
    self.manifests.pop(os.path.basename(prefix), None)
    if self.latest == prefix:
      self.latest = self.managed[-1].prefix if self.managed else None


def _state(directory):
  try:
    return tf.train.get_checkpoint_state(directory)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("tfdp: ignoring the unreadable checkpoint state file of %s: %s",
                    directory, e)
    return None


def read(layout: layout_lib.Layout, now: float) -> Catalog:
  """Reads the checkpoints of `layout`'s directory, with TF's rules for its state file.

  A checkpoint listed in TF's `checkpoint` file is managed when it is newer
  than the last preserved one (as TF decides); one with a tfdp manifest but
  not listed (a crash between the commit and the state file) is managed when
  newer too; with no state file, every tfdp checkpoint is. A listed one
  without a manifest is TF's own: restored and retained like the others.
  """
  found = layout.scan()
  usable = {b for b, kinds in found.items()
            if "manifest" in kinds or ("index" in kinds and "corrupt" not in kinds)}
  manifests = {}
  for base in sorted(usable):
    if "manifest" in found[base]:
      man = manifest_lib.read_manifest(os.path.join(layout.directory, base))
      if man is not None:
        manifests[base] = man
  state = _state(layout.directory)
  entries, latest = {}, None
  if state is None:
    last_preserved = now - 1.0
    for base, man in manifests.items():
      entries[base] = man.time
  else:
    last_preserved = min(state.last_preserved_timestamp, now)
    paths = list(state.all_model_checkpoint_paths)
    stamps = list(state.all_model_checkpoint_timestamps) or [last_preserved] * len(paths)
    for path, stamp in zip(paths, stamps):
      base = os.path.basename(path)
      if base in usable and layout.parse(base + ".index") is not None:
        stamp = manifests[base].time if base in manifests else min(stamp, now)
        if stamp > last_preserved:
          entries[base] = stamp
    for base, man in manifests.items():
      if base not in entries and man.time > last_preserved:
        entries[base] = man.time
    base = os.path.basename(state.model_checkpoint_path or "")
    if base in usable and layout.parse(base + ".index") is not None:
      latest = os.path.join(layout.directory, base)
  managed = sorted(
      (retention.Entry(os.path.join(layout.directory, b), layout_lib.number_of(b), t,
                       manifests[b].metrics if b in manifests else {})
       for b, t in entries.items()), key=lambda e: e.number)
  if managed and (latest is None or managed[-1].number > layout_lib.number_of(latest)):
    latest = managed[-1].prefix
  return Catalog(managed, latest, last_preserved, manifests)


def write_state(layout: layout_lib.Layout, catalog: Catalog) -> None:
  """Writes TF's `checkpoint` file, so tf.train.latest_checkpoint and TF's manager agree."""
  if catalog.latest is None:
    if fs.exists(layout.state_path):
      fs.remove(layout.state_path)
    return
  checkpoint_management.update_checkpoint_state_internal(
      save_dir=layout.directory, model_checkpoint_path=catalog.latest,
      all_model_checkpoint_paths=[e.prefix for e in catalog.managed],
      all_model_checkpoint_timestamps=[e.time for e in catalog.managed],
      last_preserved_timestamp=catalog.last_preserved, save_relative_paths=True)
