"""The names of every file in a checkpoint directory (one owner of the on-disk layout)."""

import dataclasses
import os
import re

from tfdp.checkpoint import fs

MANIFEST_SUFFIX = ".manifest.json"
# Appended to the manifest of a checkpoint found corrupt at restore.
CORRUPT_SUFFIX = ".corrupt"
TMP_DIRNAME = ".tfdp-tmp"
LEASE_FILENAME = ".tfdp-lease.json"
# The run token local-tier checkpoints must match (tfdp.checkpoint.tiers).
TIERS_FILENAME = ".tfdp-tiers.json"
# TF's own state file (tf.train.get_checkpoint_state reads it).
STATE_FILENAME = "checkpoint"
# Root of the keys of per-worker state: `_tfdp_per_worker/<worker>/<key>`.
PER_WORKER_ROOT = "_tfdp_per_worker"

KINDS = ("index", "data", "manifest", "manifest_tmp", "corrupt")
_KIND_RE = (r"(?P<kind>index|data-\d+-of-\d+|manifest\.json|"
            r"manifest\.json\.tmp-\d+|manifest\.json\.corrupt)")


def per_worker_prefix(worker: int) -> str:
  """Key prefix of worker `worker`'s per-worker state."""
  return f"{PER_WORKER_ROOT}/{worker}/"


def data_filename(prefix: str, shard: int, num_shards: int) -> str:
  return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def index_path(prefix: str) -> str:
  return prefix + ".index"


def manifest_path(prefix: str) -> str:
  return prefix + MANIFEST_SUFFIX


def corrupt_path(prefix: str) -> str:
  return manifest_path(prefix) + CORRUPT_SUFFIX


def number_of(prefix: str) -> int:
  """The checkpoint number of a prefix such as `/dir/ckpt-7`."""
  return int(prefix.rsplit("-", 1)[1])


@dataclasses.dataclass(frozen=True)
class FileName:
  """What a file name in a checkpoint directory is: whose and which kind."""
  base: str  # e.g. "ckpt-7"
  number: int
  kind: str  # One of KINDS.


@dataclasses.dataclass(frozen=True)
class Layout:
  """The checkpoint directory `directory` holding checkpoints `<name>-<number>`.

  Args:
    directory: the checkpoint directory.
    name: the checkpoint name; None matches checkpoints of any name (tools).
  """
  directory: str
  name: str | None = "ckpt"

  def prefix(self, number: int) -> str:
    return os.path.join(self.directory, f"{self.name}-{number}")

  @property
  def tmp_root(self) -> str:
    return os.path.join(self.directory, TMP_DIRNAME)

  def tmp_dir(self, save_id: str, number: int) -> str:
    """Temp dir of one save, shared by its workers (`save_id` names the session and save)."""
    return os.path.join(self.tmp_root, f"{save_id}-{self.name}-{number}")

  def tmp_base(self, tmp_name: str) -> str | None:
    """The checkpoint basename a temp dir (by its name) was writing, or None."""
    m = re.search(rf"-({re.escape(self.name)}-\d+)$", tmp_name)
    return m.group(1) if m else None

  @property
  def lease_path(self) -> str:
    return os.path.join(self.directory, LEASE_FILENAME)

  @property
  def tiers_path(self) -> str:
    return os.path.join(self.directory, TIERS_FILENAME)

  def committed(self) -> list[str]:
    """Prefixes of the checkpoints with a manifest, oldest (lowest number) first."""
    found = self.scan()
    bases = [b for b, kinds in found.items() if "manifest" in kinds]
    return [os.path.join(self.directory, b)
            for b in sorted(bases, key=lambda b: int(b.rsplit("-", 1)[1]))]

  @property
  def state_path(self) -> str:
    return os.path.join(self.directory, STATE_FILENAME)

  @staticmethod
  def marker_path(tmp_dir: str, worker: int) -> str:
    return os.path.join(tmp_dir, f"w{worker:05d}.done.json")

  @staticmethod
  def failed_path(tmp_dir: str) -> str:
    return os.path.join(tmp_dir, "FAILED.json")

  @staticmethod
  def shard_prefix(tmp_dir: str, worker: int, j: int) -> str:
    return os.path.join(tmp_dir, f"w{worker:05d}-{j:05d}")

  def parse(self, filename: str) -> FileName | None:
    """What `filename` (a basename) is, or None when it is not a checkpoint file."""
    name = ".+?" if self.name is None else re.escape(self.name)
    m = re.match(rf"^(?P<base>{name}-(?P<num>\d+))\.{_KIND_RE}$", filename)
    if not m:
      return None
    kind = next(k for k, p in _KIND_PATTERNS.items() if p.fullmatch(m.group("kind")))
    return FileName(m.group("base"), int(m.group("num")), kind)

  def scan(self) -> dict[str, set[str]]:
    """{base: kinds present} of every checkpoint file in the directory."""
    out = {}
    for fname in fs.listdir(self.directory):
      parsed = self.parse(fname)
      if parsed is not None:
        out.setdefault(parsed.base, set()).add(parsed.kind)
    return out

  def files_of(self, prefix: str) -> list[str]:
    """Paths of the index and data files of checkpoint `prefix`."""
    base = os.path.basename(prefix)
    return [os.path.join(self.directory, f) for f in fs.listdir(self.directory)
            if (p := self.parse(f)) is not None and p.base == base
            and p.kind in ("index", "data")]


_KIND_PATTERNS = {
    "index": re.compile(r"index"),
    "data": re.compile(r"data-\d+-of-\d+"),
    "manifest": re.compile(r"manifest\.json"),
    "manifest_tmp": re.compile(r"manifest\.json\.tmp-\d+"),
    "corrupt": re.compile(r"manifest\.json\.corrupt"),
}
