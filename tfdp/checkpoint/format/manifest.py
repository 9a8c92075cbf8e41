"""The typed checkpoint manifest (the commit record of both tiers), its JSON form, and verification against it.

Integrity of the bytes: in a persistent checkpoint the `.index` file has a
CRC-32 in the manifest, and each data file lists its tensors, whose CRC32C
TensorFlow's BundleWriter stores in the index as it writes them and its
reader checks on every read (restore included), so a data file is never read
back at save time. A local copy is one raw slot file (tfdp.checkpoint.local.slots)
whose record lists every tensor: its key, dtype, shape, offset, size and
CRC32C, and the copy's sequence number. Version-1 to 3 manifests are still
read.
"""

import dataclasses
import json
import os
import zlib

import tensorflow as tf

from tfdp import _version
from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout

# Format of the manifest; bump on incompatible changes.
MANIFEST_VERSION = 4
FORMAT = "tfdp-checkpoint"
# A checksum that detects flipped bytes and truncation, which is what a
# manifest is for (not tampering), and costs less than the write it protects.
CHECKSUM = "crc32"
_READ_CHUNK = 16 << 20


@dataclasses.dataclass
class SlotTensor:
  """One tensor of a local copy's slot file: where its bytes are, and their CRC32C.

  Strings are stored as TensorFlow's tensor bundles store them (varint
  lengths, their masked CRC32C, the bytes), and `crc32c` is the one TF's
  reader checks, so a TF index can describe the slot (tfdp.checkpoint.local.bundle).
  """
  key: str
  dtype: str  # A TF dtype name, e.g. "float32", "string".
  shape: list[int]
  offset: int
  size: int
  crc32c: int  # Unmasked.

  def to_list(self) -> list:
    return [self.key, self.dtype, list(self.shape), self.offset, self.size, self.crc32c]

  @classmethod
  def from_list(cls, row) -> "SlotTensor":
    """The inverse of `to_list` (types are checked by tfdp.checkpoint.local.slots.check_entries)."""
    if not isinstance(row, list) or len(row) != 6:
      raise ValueError(f"not a slot tensor record: {str(row)[:80]}")
    return cls(*row)


@dataclasses.dataclass
class FileRecord:
  """One file of a committed checkpoint."""
  name: str
  size: int
  crc32: str | None = None  # The index (and every file of a v1 manifest).
  tensors: list[str] | None = None  # A data file: keys whose CRC32C TF keeps.
  entries: list[SlotTensor] | None = None  # A local copy's slot file (its used bytes: `size`).

  def to_dict(self) -> dict:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if getattr(self, f.name) is not None}
    if self.entries is not None:
      out["entries"] = [e.to_list() for e in self.entries]
    return out

  @classmethod
  def from_dict(cls, d: dict) -> "FileRecord":
    if not isinstance(d, dict):
      raise ValueError("a file record that is not an object")
    kw = {k: v for k, v in d.items() if k in ("name", "size", "crc32", "tensors")}
    if d.get("entries") is not None:
      if not isinstance(d["entries"], list):
        raise ValueError("slot entries that are not a list")
      kw["entries"] = [SlotTensor.from_list(e) for e in d["entries"]]
    return cls(**kw)


@dataclasses.dataclass
class SaveMeta:
  """What the manager knows of a save before it is written."""
  checkpoint_number: int
  step: int
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  global_batch_size: int | None = None
  per_worker_keys: list[str] = dataclasses.field(default_factory=list)
  versions: dict[str, str] = dataclasses.field(default_factory=dict)
  # "persistent" (model_dir) or "local" (one worker's copy, tfdp.checkpoint.local).
  tier: str = "persistent"
  # A local checkpoint's run (the token in the persistent directory).
  run_token: str = ""
  # A local checkpoint: whether its per-worker state must be restored exactly
  # (False: it can be recovered from peers without it).
  per_worker_required: bool = True


  @classmethod
  def new(cls, number: int, step: int, metrics: dict | None, global_batch_size: int | None,
          per_worker_keys: list[str], **extra) -> "SaveMeta":
    """The SaveMeta of a save now, with the versions of tfdp, TensorFlow and Keras."""
    import keras  # pylint: disable=g-import-not-at-top
    return cls(checkpoint_number=number, step=step,
               metrics={str(k): float(v) for k, v in (metrics or {}).items()},
               global_batch_size=global_batch_size, per_worker_keys=per_worker_keys,
               versions={"tfdp": _version.__version__, "tensorflow": tf.__version__,
                         "keras": keras.__version__}, **extra)


@dataclasses.dataclass
class Manifest(SaveMeta):
  """The commit record of one checkpoint: a checkpoint exists once its manifest does."""
  prefix: str = ""  # Basename, e.g. "ckpt-7".
  time: float = 0.0
  files: list[FileRecord] = dataclasses.field(default_factory=list)
  num_shards: int = 0
  total_bytes: int = 0
  state_bytes: int = 0
  world_size: int = 1
  session: str = ""
  writers: dict[str, dict] = dataclasses.field(default_factory=dict)
  # Basenames the manager keeps after this save (decided before it started),
  # so every worker lists the same checkpoints.
  kept: list[str] = dataclasses.field(default_factory=list)
  # A local copy: this worker's count of its copies, so of two records that
  # name the same slot only the newer can describe its bytes.
  sequence: int = 0
  manifest_version: int = MANIFEST_VERSION

  @property
  def slot(self) -> FileRecord | None:
    """The slot file of a local copy (None: a checkpoint of TF bundles)."""
    return self.files[0] if len(self.files) == 1 and self.files[0].entries is not None else None

  def to_json(self) -> str:
    # Shallow (no deep copy of every tensor key, as dataclasses.asdict makes):
    # the local tier writes one at every save.
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["files"] = [f.to_dict() for f in self.files]
    d["format"] = FORMAT
    return json.dumps(d, indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "Manifest":
    """Parses a manifest of any version up to MANIFEST_VERSION.

    Raises:
      ValueError: `text` is not a tfdp manifest (incomplete JSON included).
      CheckpointError: it was written by a newer tfdp.
    """
    d = json.loads(text)
    if not isinstance(d, dict) or "files" not in d or "prefix" not in d:
      raise ValueError("not a tfdp manifest")
    version = int(d.get("manifest_version", 1))
    if version > MANIFEST_VERSION:
      raise errors.CheckpointError(
          f"Manifest version {version} was written by a newer tfdp (this one "
          f"reads up to {MANIFEST_VERSION}); upgrade tfdp.")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in d.items() if k in fields}
    if not isinstance(d["files"], list):
      raise ValueError("files that are not a list")
    kwargs["files"] = [FileRecord.from_dict(f) for f in d["files"]]
    kwargs.setdefault("checkpoint_number", layout.number_of(d["prefix"]))
    kwargs.setdefault("step", kwargs["checkpoint_number"])
    kwargs["metrics"] = kwargs.get("metrics") or {}
    return cls(**kwargs)


def read_manifest(prefix: str) -> Manifest | None:
  """The manifest of checkpoint `prefix`, or None when it has none (or a torn one)."""
  try:
    with tf.io.gfile.GFile(layout.manifest_path(prefix), "r") as f:
      return Manifest.from_json(f.read())
  except (tf.errors.NotFoundError, ValueError, TypeError, KeyError):
    return None


def write_manifest(prefix: str, manifest: Manifest) -> None:
  """Writes the manifest atomically: the commit point of checkpoint `prefix`."""
  fs.write_atomic(layout.manifest_path(prefix), manifest.to_json())


def file_checksum(path: str) -> tuple[int, str]:
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


def describe_file(path: str) -> FileRecord:
  """The record of a file checked by its own CRC-32 (the index)."""
  size, crc = file_checksum(path)
  return FileRecord(os.path.basename(path), size, crc32=crc)


def describe_data_file(path: str, tensors: list[str]) -> FileRecord:
  """The record of a data file: its bytes are covered by TF's per-tensor CRC32C."""
  return FileRecord(os.path.basename(path), fs.size(path), tensors=list(tensors))


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
        from tfdp.checkpoint.local import slots  # pylint: disable=g-import-not-at-top  (it imports this module)
        try:
          slots.check_entries(entry.entries, entry.size)
          slots.read(path, entry.entries, entry.size)
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
