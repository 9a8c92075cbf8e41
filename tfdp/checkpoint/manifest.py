"""Checkpoint manifests: file sizes and checksums, atomic JSON writes, verification.

Integrity of the bytes: the `.index` file has a CRC-32 in the manifest; each
data file lists its tensors, whose CRC32C TensorFlow's BundleWriter stores in
the index as it writes them and its reader checks on every read (restore
included). A data file is therefore never read back to checksum it at save
time. Version-1 manifests (CRC-32 of every file) are still verified.
"""

import json
import os
import zlib

import tensorflow as tf

from tfdp import errors

# Format of the manifest; bump on incompatible changes.
MANIFEST_VERSION = 2
MANIFEST_SUFFIX = ".manifest.json"
# zlib's CRC-32 runs at ~1.5 GB/s on one core here (sha256: ~0.57 GB/s), so a
# checksum costs less than the disk write it protects; it detects flipped bytes
# and truncation, which is what a manifest is for (not tampering).
CHECKSUM = "crc32"
_READ_CHUNK = 16 << 20


def is_local(path):
  """True for paths of the local file system (fsync applies)."""
  return "://" not in path or path.startswith("file://")


def _local(path):
  return path[len("file://"):] if path.startswith("file://") else path


def fsync_file(path):
  """Flushes `path` to stable storage (no-op for object stores: close is durable)."""
  if not is_local(path):
    return
  fd = os.open(_local(path), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_dir(path):
  """Makes renames and creations inside directory `path` durable."""
  if not is_local(path):
    return
  try:
    fd = os.open(_local(path), os.O_RDONLY | os.O_DIRECTORY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def file_checksum(path):
  """Returns (size, crc32 as 8 hex digits) of the file at `path`."""
  crc = 0
  size = 0
  with tf.io.gfile.GFile(path, "rb") as f:
    while True:
      chunk = f.read(_READ_CHUNK)
      if not chunk:
        break
      crc = zlib.crc32(chunk, crc)
      size += len(chunk)
  return size, f"{crc & 0xFFFFFFFF:08x}"


def describe_file(path):
  """Returns the manifest entry {name, size, crc32} of the file at `path`."""
  size, crc = file_checksum(path)
  return {"name": os.path.basename(path), "size": size, CHECKSUM: crc}


def describe_data_file(path, tensors):
  """Returns the manifest entry {name, size, tensors} of a data file.

  Its bytes are covered by the per-tensor CRC32C that TensorFlow keeps in
  the index, so the file is not read back.
  """
  return {"name": os.path.basename(path), "size": tf.io.gfile.stat(path).length,
          "tensors": list(tensors)}


def _tensor_problems(prefix, checks):
  """Reads the tensors of each (path, keys) in `checks` (TF checks each CRC32C)."""
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


def write_json_atomic(path, obj):
  """Writes `obj` as JSON to `path` so readers see all of it or nothing."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    f.write(json.dumps(obj, indent=1, sort_keys=True))
  fsync_file(tmp)
  tf.io.gfile.rename(tmp, path, overwrite=True)
  fsync_dir(os.path.dirname(path))


def read_json(path):
  """Reads a JSON file; None if it does not exist or is not complete JSON."""
  try:
    with tf.io.gfile.GFile(path, "r") as f:
      return json.loads(f.read())
  except (tf.errors.NotFoundError, ValueError):
    return None


def manifest_path(prefix):
  return prefix + MANIFEST_SUFFIX


def read_manifest(prefix):
  """Returns the manifest dict of checkpoint `prefix`, or None when uncommitted."""
  return read_json(manifest_path(prefix))


def check_files(prefix, manifest=None, checksums=True):
  """Returns a list of problems ("FILE: what is wrong") of checkpoint `prefix`.

  Args:
    prefix: checkpoint prefix, e.g. `/dir/ckpt-5`.
    manifest: the manifest, read from disk when None.
    checksums: also compare checksums (reads every byte); else sizes only.
  """
  if manifest is None:
    manifest = read_manifest(prefix)
  if manifest is None:
    return [f"{manifest_path(prefix)}: no manifest (checkpoint not committed "
            "by tfdp, or its save did not finish)"]
  directory = os.path.dirname(prefix)
  problems = []
  tensor_checks = []
  for entry in manifest["files"]:
    path = os.path.join(directory, entry["name"])
    if not tf.io.gfile.exists(path):
      problems.append(f"{path}: missing")
      continue
    size = tf.io.gfile.stat(path).length
    if size != entry["size"]:
      problems.append(f"{path}: size {size} bytes, manifest says "
                      f"{entry['size']} (truncated or overwritten)")
      continue
    if checksums and CHECKSUM in entry:
      _, crc = file_checksum(path)
      if crc != entry[CHECKSUM]:
        problems.append(f"{path}: {CHECKSUM} {crc}, manifest says "
                        f"{entry[CHECKSUM]} (corrupt)")
    elif checksums and "tensors" in entry:
      tensor_checks.append((path, entry["tensors"]))
  # Tensors only once the index and every size are right: the reader needs them.
  if not problems and tensor_checks:
    problems = _tensor_problems(prefix, tensor_checks)
  return problems


def verify(prefix, manifest=None, checksums=True):
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
