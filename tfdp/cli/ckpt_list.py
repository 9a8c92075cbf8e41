"""tfdp-ckpt's `ls` and `verify`: a directory's checkpoints and what was checked, through the format's records (no TensorFlow for `ls`)."""

import os

from tfdp import errors
from tfdp.checkpoint.format import directory as directory_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import units
from tfdp.checkpoint.format import verify as verify_lib


def _tf_state(directory):
  """(latest, all) checkpoint basenames TF's `checkpoint` state file names."""
  try:
    state = directory_lib.read_state(directory)
  except ValueError:  # Not TF's: nothing it names.
    state = None
  if state is None:
    return None, set()
  return os.path.basename(state.latest), {os.path.basename(p) for p in state.paths}


def _checkpoints(directory):
  """{base: {kind: [file names]}} of every checkpoint in `directory` with an index or manifest, by number."""
  found = directory_lib.files(layout_lib.Layout(directory, None))
  return {base: kinds for base, kinds in sorted(found.items(),
                                                 key=lambda b: layout_lib.number_of(b[0]))
          if {"index", "manifest"} & set(kinds)}


def _ls_row(directory, base, kinds, state, checksums):
  """(checkpoint, step, size, shards, world, status) of checkpoint `base`."""
  prefix = os.path.join(directory, base)
  try:
    man = manifest_lib.read_manifest(prefix)
  except errors.CheckpointError as e:  # A newer tfdp's, or one that does not parse: a row.
    return (base, "-", "-", "-", "-", f"unreadable manifest: {e}")
  latest = " (latest)" if base == state[0] else ""
  if man is None:  # TF's own checkpoint, a torn save, or one set aside
    data = kinds.get("data", [])
    size = sum(fs.size(os.path.join(directory, f)) for f in data + kinds.get("index", []))
    if "corrupt" in kinds:
      status = f"set aside as corrupt ({os.path.basename(layout_lib.corrupt_path(prefix))})"
    elif base in state[1]:
      status = "TF checkpoint (no tfdp manifest; files not checked)" + latest
    else:
      status = "no tfdp manifest (written by TF itself, or a torn save)"
    return (base, "-", units.human_bytes(size), str(len(data)) if data else "-", "-", status)
  problems = verify_lib.check_files(prefix, man, checksums=checksums)
  # Never "intact" unchecked: sizes match says nothing of the bytes.
  checked = "verified (every byte)" if checksums else "sizes ok (bytes not read: --verify)"
  status = (checked + latest) if not problems else "CORRUPT: " + "; ".join(problems)
  return (base, str(man.step), units.human_bytes(man.total_bytes), str(man.num_shards),
          str(man.world_size), status)


def cmd_ls(args, out):
  """Lists the checkpoints of a directory; reads no tensor (TensorFlow only for --checksums or a URL)."""
  state = _tf_state(args.dir)
  rows = [("CHECKPOINT", "STEP", "SIZE", "SHARDS", "WORLD", "STATUS")]
  rows += [_ls_row(args.dir, base, kinds, state, args.checksums)
           for base, kinds in _checkpoints(args.dir).items()]
  table(rows, out)
  return 0


def table(rows, out, indent=""):
  """Writes `rows` in left-aligned columns; the last column is not padded."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
  for r in rows:
    out.write(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] + "\n")


def cmd_verify(args, out):
  """Checks every byte of one checkpoint against its manifest: exit 0 only if all match."""
  problems = verify_lib.check_files(args.path)
  if problems:
    for p in problems:
      out.write(f"BAD {p}\n")
    return 1
  man = manifest_lib.read_manifest(args.path)
  out.write(f"OK {args.path}: {len(man.files)} files, "
            f"{man.total_bytes} bytes match the manifest\n")
  return 0


def size_problems(prefix: str) -> list[str]:
  """The files of tfdp checkpoint `prefix` missing or of another size than its manifest says ([] for TF's own)."""
  man = manifest_lib.read_manifest(prefix)
  return verify_lib.check_files(prefix, man, checksums=False) if man is not None else []

