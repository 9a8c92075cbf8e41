"""The typed checkpoint manifest (the commit record of both tiers) and its JSON form; no TensorFlow.

What the records say of the bytes: in a persistent checkpoint the `.index`
file has a CRC-32, and each data file lists its tensors, whose CRC32C
TensorFlow keeps in the index; a local copy is one raw slot file
(tfdp.checkpoint.local.slots) whose record lists every tensor: its key,
dtype, shape, offset, size and CRC32C, and the copy's sequence number.
Checking the bytes against them is tfdp.checkpoint.format.verify's.
Version-1 to 3 manifests are still read.
"""

import collections.abc
import dataclasses
import json
import typing

from tfdp import _version
from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout

# Format of the manifest; bump on incompatible changes.
MANIFEST_VERSION = 4
FORMAT = "tfdp-checkpoint"


class SlotTensor(typing.NamedTuple):
  """One tensor of a local copy's slot file: where its bytes are, and their CRC32C.

  Strings are stored as TensorFlow's tensor bundles store them (varint
  lengths, their masked CRC32C, the bytes), and `crc32c` is the one TF's
  reader checks, so a TF index can describe the slot (tfdp.checkpoint.local.bundle).
  A copy's record holds them as columns (`SlotEntries`); one is made when
  asked for.
  """
  key: str
  dtype: str  # A TF dtype name, e.g. "float32", "string".
  shape: tuple[int, ...]
  offset: int
  size: int
  crc32c: int  # Unmasked.


class SlotEntries(collections.abc.Sequence):
  """The records of a slot's tensors (a Sequence of SlotTensor), held as six columns.

  A local copy's record lists every tensor of a worker's state, hundreds
  for a real model at every save, and lives while the copy is held. Held
  as one object a tensor, each record is tracked by Python's garbage
  collector, outlives the young collections and ends up in its oldest
  generation, where every 25% more objects start a full collection of the
  training process's whole heap (hundreds of ms each, holding the GIL;
  docs/performance.md, "Sixth pass"). Held as columns, a record is six
  lists, whatever its length: its strings and numbers are not tracked, nor
  are its shapes (tuples of numbers, which the collector stops tracking).
  Indexing and iterating make the SlotTensors on the way.
  """

  __slots__ = ("keys", "dtypes", "shapes", "offsets", "sizes", "crcs")

  def __init__(self, keys=(), dtypes=(), shapes=(), offsets=(), sizes=(), crcs=()):
    columns = [list(c) for c in (keys, dtypes, shapes, offsets, sizes, crcs)]
    if len({len(c) for c in columns}) > 1:
      raise ValueError("slot entries' columns of different lengths")
    self.keys, self.dtypes, self.shapes, self.offsets, self.sizes, self.crcs = columns

  @classmethod
  def of(cls, records) -> "SlotEntries":
    """The entries of SlotTensors (or rows of their six fields)."""
    rows = list(records)
    return cls(*zip(*rows)) if rows else cls()

  @classmethod
  def from_rows(cls, rows: list) -> "SlotEntries":
    """The entries of their JSON rows (types are checked by tfdp.checkpoint.format.slot_file.check_entries)."""
    for row in rows:
      if not isinstance(row, list) or len(row) != 6:
        raise ValueError(f"not a slot tensor record: {str(row)[:80]}")
    out = cls.of(rows)
    out.shapes = [tuple(s) if isinstance(s, list) else s for s in out.shapes]
    return out

  def rows(self) -> list[tuple]:
    """Their JSON rows (made for the writing, not kept)."""
    return list(zip(self.keys, self.dtypes, self.shapes, self.offsets, self.sizes, self.crcs))

  def __len__(self) -> int:
    return len(self.keys)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return SlotEntries(self.keys[i], self.dtypes[i], self.shapes[i], self.offsets[i],
                         self.sizes[i], self.crcs[i])
    return SlotTensor(self.keys[i], self.dtypes[i], self.shapes[i], self.offsets[i],
                      self.sizes[i], self.crcs[i])

  def __iter__(self):
    return map(SlotTensor._make, zip(self.keys, self.dtypes, self.shapes, self.offsets,
                                     self.sizes, self.crcs))

  def __add__(self, other) -> "SlotEntries":
    other = other if isinstance(other, SlotEntries) else SlotEntries.of(other)
    return SlotEntries(self.keys + other.keys, self.dtypes + other.dtypes,
                       self.shapes + other.shapes, self.offsets + other.offsets,
                       self.sizes + other.sizes, self.crcs + other.crcs)

  def __eq__(self, other) -> bool:
    if not isinstance(other, collections.abc.Sequence) or isinstance(other, (str, bytes)):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other))

  __hash__ = None

  def __repr__(self) -> str:
    return f"SlotEntries({list(self)!r})"


@dataclasses.dataclass
class FileRecord:
  """One file of a committed checkpoint."""
  name: str
  size: int
  crc32: str | None = None  # The index (and every file of a v1 manifest).
  tensors: list[str] | None = None  # A data file: keys whose CRC32C TF keeps.
  entries: SlotEntries | None = None  # A local copy's slot file (its used bytes: `size`).

  def __post_init__(self):
    if self.entries is not None and not isinstance(self.entries, SlotEntries):
      self.entries = SlotEntries.of(self.entries)  # A list of SlotTensors.

  def to_dict(self) -> dict:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if getattr(self, f.name) is not None}
    if self.entries is not None:
      out["entries"] = self.entries.rows()
    return out

  @classmethod
  def from_dict(cls, d: dict) -> "FileRecord":
    if not isinstance(d, dict):
      raise ValueError("a file record that is not an object")
    kw = {k: v for k, v in d.items() if k in ("name", "size", "crc32", "tensors")}
    if d.get("entries") is not None:
      if not isinstance(d["entries"], list):
        raise ValueError("slot entries that are not a list")
      kw["entries"] = SlotEntries.from_rows(d["entries"])
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
    import tensorflow as tf  # pylint: disable=g-import-not-at-top  (the records load without it)
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
    return json.dumps(d, sort_keys=True)  # One line: indent makes json use its Python encoder (10x slower).

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
    kwargs["manifest_version"] = version  # What it was written as (1 when it does not say).
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
    text = fs.read_text(layout.manifest_path(prefix))
    return None if text is None else Manifest.from_json(text)
  except (ValueError, TypeError, KeyError):
    return None


def write_manifest(prefix: str, manifest: Manifest) -> None:
  """Writes the manifest atomically: the commit point of checkpoint `prefix`."""
  fs.write_atomic(layout.manifest_path(prefix), manifest.to_json())


