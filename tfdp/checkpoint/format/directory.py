"""What a checkpoint directory holds: its files by checkpoint and kind, and what TF's state file names (no TensorFlow for local paths)."""

import codecs
import dataclasses
import os
import re

from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib


def files(layout: layout_lib.Layout) -> dict[str, dict[str, list[str]]]:
  """{base: {kind: [file names]}} of every checkpoint file in `layout`'s directory."""
  out = {}
  for fname in fs.listdir(layout.directory):
    parsed = layout.parse(fname)
    if parsed is not None:
      out.setdefault(parsed.base, {}).setdefault(parsed.kind, []).append(fname)
  return out


def scan(layout: layout_lib.Layout) -> dict[str, set[str]]:
  """{base: kinds present} of every checkpoint file in `layout`'s directory."""
  return {base: set(kinds) for base, kinds in files(layout).items()}


def committed(layout: layout_lib.Layout) -> list[str]:
  """Prefixes of the checkpoints with a manifest, oldest (lowest number) first."""
  bases = [b for b, kinds in scan(layout).items() if "manifest" in kinds]
  return [os.path.join(layout.directory, b)
          for b in sorted(bases, key=lambda b: int(b.rsplit("-", 1)[1]))]


def files_of(layout: layout_lib.Layout, prefix: str) -> list[str]:
  """Paths of the index and data files of checkpoint `prefix` (of any name)."""
  base = os.path.basename(prefix)
  found = files(layout_lib.Layout(layout.directory, None)).get(base, {})
  return [os.path.join(layout.directory, f)
          for kind in ("index", "data") for f in found.get(kind, [])]


@dataclasses.dataclass(frozen=True)
class StateFile:
  """TF's `checkpoint` state file (a CheckpointState in text form), paths as written."""
  latest: str
  paths: list[str]
  timestamps: list[float]
  last_preserved: float


# `field: "text"` or `field: number`, one a line (what TF's text form writes).
_STATE_LINE = re.compile(r'^\s*(\w+)\s*:\s*(?:"((?:[^"\\]|\\.)*)"|(\S+))\s*$')


def read_state(directory: str) -> StateFile | None:
  """TF's state file of `directory` (tf.train.get_checkpoint_state's), or None when it has none.

  Raises:
    ValueError: the file is not a CheckpointState, or names no latest checkpoint.
  """
  text = fs.read_text(os.path.join(directory, layout_lib.STATE_FILENAME))
  if text is None:
    return None
  fields = {}
  for line in text.splitlines():
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    m = _STATE_LINE.match(line)
    if m is None:
      raise ValueError(f"not a checkpoint state line: {line[:80]!r}")
    # Protobuf's text format: raw UTF-8 or C escapes (octal bytes, \"), bytes first.
    value = (codecs.escape_decode(m.group(2).encode())[0].decode("utf-8") if m.group(2) is not None
             else float(m.group(3)))
    fields.setdefault(m.group(1), []).append(value)
  latest = fields.get("model_checkpoint_path", [""])[-1]
  if not latest:
    raise ValueError("a checkpoint state that names no checkpoint")
  return StateFile(latest, list(fields.get("all_model_checkpoint_paths", [])),
                   [float(t) for t in fields.get("all_model_checkpoint_timestamps", [])],
                   float(fields.get("last_preserved_timestamp", [0.0])[-1]))
