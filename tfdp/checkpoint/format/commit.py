"""The one commit point and the one delete of both tiers: a manifest written last, removed first.

A checkpoint exists once its manifest does: `commit` writes it after every
file is durable (fenced by the writer's lease), `delete` removes it before
the files, `set_aside` uncommits a corrupt one, and `cleanup` removes what
torn saves left.
"""

from collections.abc import Callable
import os
import time

from absl import logging

from tfdp.checkpoint.format import directory
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib


def commit(prefix: str, man: manifest_lib.Manifest,
           fence: Callable[[], None] | None = None) -> manifest_lib.Manifest:
  """The commit point of every checkpoint, of both tiers: the manifest, written last.

  Args:
    prefix: the checkpoint, its files durable.
    man: its manifest.
    fence: called just before the manifest is written; raises when this
      writer may no longer commit (a lost lease).

  Returns:
    `man`, committed.
  """
  if fence is not None:
    fence()
  manifest_lib.write_manifest(prefix, man)
  return man


def delete(layout: layout_lib.Layout, prefix: str) -> None:
  """Deletes checkpoint `prefix`: its manifest first, so a crash leaves no committed half."""
  path = layout_lib.manifest_path(prefix)
  try:
    if fs.exists(path):
      fs.remove(path)
  except fs.failures() as e:  # Still committed: its files stay too.
    logging.warning("tfdp: could not delete old checkpoint %s: %s", prefix, e)
    return
  for path in directory.files_of(layout, prefix):
    try:
      fs.remove(path)
    except FileNotFoundError:
      pass  # Gone already (a cleanup, or another worker's delete).
    except fs.failures() as e:  # Uncommitted: a later cleanup removes what stays.
      logging.warning("tfdp: could not delete %s of old checkpoint %s: %s", path, prefix, e)


def set_aside(prefix: str, error: str) -> None:
  """Uncommits corrupt checkpoint `prefix`: its manifest becomes `.corrupt` (a marker when it has none)."""
  path, aside = layout_lib.manifest_path(prefix), layout_lib.corrupt_path(prefix)
  if fs.exists(path):
    fs.rename(path, aside)
  else:
    fs.write_json_atomic(aside, {"error": error, "time": time.time()})


def cleanup(layout: layout_lib.Layout, session: str | None = None,
            private: bool = False) -> None:
  """Deletes leftovers of torn saves: temp dirs, and files of uncommitted checkpoints.

  Index and data files without a manifest are deleted only when a temp dir
  of theirs is left (a save that merged but did not commit) or their
  manifest was set aside as corrupt: files that TF wrote itself (no
  manifest, no temp dir) are the user's and stay, except in a `private`
  directory (a local tier's), where every uncommitted file is torn.

  Args:
    layout: the checkpoint directory.
    session: temp dirs of this session are in use and kept.
    private: only tfdp writes into the directory.
  """
  torn = set()
  for sub in fs.listdir(layout.tmp_root):
    if session is not None and sub.startswith(session + "-"):
      continue
    torn.add(layout.tmp_base(sub))
    logging.info("tfdp: removing %s (left by a save that did not commit)", sub)
    fs.rmtree(os.path.join(layout.tmp_root, sub))
  if private:  # Whatever name a torn write left (a received copy's too).
    layout = layout_lib.Layout(layout.directory, None)
  for base, kinds in directory.files(layout).items():
    for kind, names in kinds.items():
      if kind == "manifest_tmp" or (
          kind in ("index", "data") and "manifest" not in kinds and
          (private or base in torn or "corrupt" in kinds)) or (
          kind == "tf_tmp" and (private or base in torn)):
        for fname in names:
          logging.info("tfdp: removing %s (left by a save that did not commit)", fname)
          fs.remove(os.path.join(layout.directory, fname))
