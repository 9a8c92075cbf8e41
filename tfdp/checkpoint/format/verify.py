"""Checks a checkpoint's bytes against its manifest: sizes, the index's CRC-32, each tensor's CRC32C, slot files.

In a persistent checkpoint the `.index` file has a CRC-32 in the manifest,
and each data file lists its tensors, whose CRC32C TensorFlow's BundleWriter
stores in the index as it writes them and its reader checks on every read
(restore included), so a data file is never read back at save time.

Sizes and CRC-32s need no TensorFlow (`tfdp-ckpt ls` checks sizes without
it); the tensors' CRC32C are TF's reader's, and a slot file's the local
tier's, imported when bytes are checked.
"""

import os
import zlib

from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout
from tfdp.checkpoint.format.manifest import FileRecord
from tfdp.checkpoint.format.manifest import Manifest
from tfdp.checkpoint.format.manifest import read_manifest

# A checksum that detects flipped bytes and truncation, which is what a
# manifest is for (not tampering), and costs less than the write it protects.
CHECKSUM = "crc32"
_READ_CHUNK = 16 << 20


def file_checksum(path: str) -> tuple[int, str]:
  """Returns (size, crc32 as 8 hex digits) of the file at `path`."""
  crc = 0
  size = 0
  with fs.open_binary(path) as f:
    while True:
      chunk = f.read(_READ_CHUNK)
      if not chunk:
        break
      crc = zlib.crc32(chunk, crc)
      size += len(chunk)
  return size, f"{crc & 0xFFFFFFFF:08x}"


def describe_file(path: str) -> FileRecord:
  """The record of a file checked by its own CRC-32 (the index)."""
  size, crc = file_checksum(path)
  return FileRecord(os.path.basename(path), size, crc32=crc)


def describe_data_file(path: str, tensors: list[str]) -> FileRecord:
  """The record of a data file: its bytes are covered by TF's per-tensor CRC32C."""
  return FileRecord(os.path.basename(path), fs.size(path), tensors=list(tensors))


def _tensor_problems(prefix, checks):
  """Reads the tensors of each (path, keys) in `checks` (TF checks each CRC32C)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (sizes are checked without it)
  try:
    reader = tf.train.load_checkpoint(prefix)
  except tf.errors.OpError as e:
    return [f"{prefix}: cannot open the checkpoint to check it: {e}"]
  problems = []
  for path, keys in checks:
    for key in keys:
      try:
        reader.get_tensor(key)
      except tf.errors.OpError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        problems.append(f"{path}: tensor {key!r} does not match its CRC32C "
                        f"(corrupt): {msg}")
        break
  return problems


def check_files(prefix: str, manifest: Manifest | None = None,
                checksums: bool = True) -> list[str]:
  """Returns a list of problems ("FILE: what is wrong") of checkpoint `prefix`.

  Args:
    prefix: checkpoint prefix, e.g. `/dir/ckpt-5`.
    manifest: the manifest, read from disk when None.
    checksums: also compare checksums (reads every byte); else sizes only.
  """
  if manifest is None:
    manifest = read_manifest(prefix)
  if manifest is None:
    return [f"{layout.manifest_path(prefix)}: no manifest (checkpoint not "
            "committed by tfdp, or its save did not finish)"]
  directory = os.path.dirname(prefix)
  problems = []
  tensor_checks = []
  for entry in manifest.files:
    path = os.path.join(directory, entry.name)
    if not fs.exists(path):
      problems.append(f"{path}: missing")
      continue
    size = fs.size(path)
    if entry.entries is not None:  # A slot: preallocated, its copy the first `entry.size` bytes.
      if size < entry.size:
        problems.append(f"{path}: size {size} bytes, the copy needs {entry.size} (truncated)")
      elif checksums:
        # The slot-file reader (the local tier's, with TensorFlow): only to read the bytes.
        from tfdp.checkpoint.format import slot_file  # pylint: disable=g-import-not-at-top  (TensorFlow)
        try:
          slot_file.check_entries(entry.entries, entry.size)
          slot_file.read(path, entry.entries, entry.size)
        except (ValueError, errors.CorruptCheckpointError) as e:
          problems.append(str(e))
      continue
    if size != entry.size:
      problems.append(f"{path}: size {size} bytes, manifest says "
                      f"{entry.size} (truncated or overwritten)")
      continue
    if checksums and entry.crc32 is not None:
      _, crc = file_checksum(path)
      if crc != entry.crc32:
        problems.append(f"{path}: {CHECKSUM} {crc}, manifest says "
                        f"{entry.crc32} (corrupt)")
    elif checksums and entry.tensors is not None:
      tensor_checks.append((path, entry.tensors))
  # Tensors only once the index and every size are right: the reader needs them.
  if not problems and tensor_checks:
    problems = _tensor_problems(prefix, tensor_checks)
  return problems


def verify(prefix: str, manifest: Manifest | None = None,
           checksums: bool = True) -> None:
  """Checks every file of checkpoint `prefix` against its manifest.

  Args:
    prefix: checkpoint prefix.
    manifest: the manifest, read from disk when None.
    checksums: also compare checksums (reads every byte); else sizes only.

  Raises:
    CorruptCheckpointError: naming each file that is missing, truncated or
      whose checksum differs.
  """
  problems = check_files(prefix, manifest, checksums=checksums)
  if problems:
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: " + "; ".join(problems) +
        ". Restore an older checkpoint (restore_or_initialize() does so) or "
        "delete this one.")
