"""Every name in a checkpoint directory and in a local tier (one owner of the on-disk layout).

Names only: it reads no directory (tfdp.checkpoint.persistent.catalog lists what is
there) and imports no TensorFlow, so the launcher and tfdp.goodput use it.
"""

import dataclasses
import hashlib
import os
import re
import stat
import tempfile

MANIFEST_SUFFIX = ".manifest.json"
# Appended to the manifest of a checkpoint found corrupt at restore.
CORRUPT_SUFFIX = ".corrupt"
# Appended (with the writer's pid) to a file being written atomically.
ATOMIC_TMP_INFIX = ".tmp-"
TMP_DIRNAME = ".tfdp-tmp"
LEASE_FILENAME = ".tfdp-lease.json"
# The run token local-tier checkpoints must match (tfdp.checkpoint.local).
TIERS_FILENAME = ".tfdp-tiers.json"
# TF's own state file (tf.train.get_checkpoint_state reads it).
STATE_FILENAME = "checkpoint"
# What a training run keeps next to its checkpoints.
LOGS_DIRNAME = "logs"
GOODPUT_FILENAME = "goodput.json"
# The goodput ledger (tfdp.goodput.ledger): the chief's record of each
# attempt and each worker's step counter, kept with the run so that a rerun
# of the same command finds the attempts before it.
GOODPUT_DIRNAME = ".tfdp-goodput"
_GOODPUT_RECORD = "attempt-{}-{}.json"
_GOODPUT_PROGRESS = "progress-{}-{}.bin"
_GOODPUT_RECORD_RE = re.compile(r"attempt-\d+-\d+\.json")
_GOODPUT_PROGRESS_RE = re.compile(r"progress-\d+-\d+\.bin")
KERAS_FILENAME = "model.keras"
# Root of the keys of per-worker state: `_tfdp_per_worker/<worker>/<key>`.
PER_WORKER_ROOT = "_tfdp_per_worker"
# The local tier: in a root private to the user ($XDG_RUNTIME_DIR/tfdp,
# else RAM-backed /dev/shm/tfdp-<uid>, else the temp dir's), made and
# checked by tfdp.checkpoint.format.private; one directory per persistent
# directory, one folder per worker.
XDG_SUBDIR = "tfdp"
_WORKER_DIR = "worker-{}"
# Inside a worker's local folder: the per-worker states it keeps of a peer,
# and the markers of a peer recovery under way (tfdp.checkpoint.recovery).
_PEER_DIR = "peer-{}"
RECOVERY_INFIX = "recovering-"

# TF's bundle writer (SaveV2) writes each file as `<file>.tempstate<random>`
# and renames it when done: a process killed mid-write leaves one ("tf_tmp").
TF_TMP_INFIX = ".tempstate"
KINDS = ("index", "data", "manifest", "manifest_tmp", "corrupt", "tf_tmp")
_KIND_RE = (r"(?P<kind>index|data-\d+-of-\d+|manifest\.json|manifest\.json"
            + re.escape(ATOMIC_TMP_INFIX) + r"\d+|manifest\.json\.corrupt|(?:index|data-\d+-of-\d+)"
            + re.escape(TF_TMP_INFIX) + r"\d+)")


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


def atomic_tmp_path(path: str) -> str:
  """Where `path` is written before it is renamed into place (one per process)."""
  return f"{path}{ATOMIC_TMP_INFIX}{os.getpid()}"


def number_of(prefix: str) -> int:
  """The checkpoint number of a prefix such as `/dir/ckpt-7`."""
  return int(prefix.rsplit("-", 1)[1])


def goodput_record_name(start: float, pid: int) -> str:
  """The ledger's record of the attempt that started at `start` (time.time()), by its chief `pid`."""
  return _GOODPUT_RECORD.format(round(start * 1e6), pid)


def goodput_progress_name(start: float, pid: int) -> str:
  """The ledger's progress file of worker process `pid` in the attempt that started at `start`."""
  return _GOODPUT_PROGRESS.format(round(start * 1e6), pid)


def is_goodput_record(filename: str) -> bool:
  return _GOODPUT_RECORD_RE.fullmatch(filename) is not None


def is_goodput_progress(filename: str) -> bool:
  return _GOODPUT_PROGRESS_RE.fullmatch(filename) is not None


def default_local_root(directory: str) -> str:
  """The local tier of persistent `directory` when none is given: in this user's private root, named by its path."""
  root = user_local_root()
  name = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:16]
  return os.path.join(root, name)


def user_local_root() -> str:
  """This user's root of local tiers: `$XDG_RUNTIME_DIR/tfdp` (when it is private), `/dev/shm/tfdp-<uid>`, the temp dir's."""
  xdg = os.environ.get("XDG_RUNTIME_DIR", "")
  try:
    st = os.lstat(xdg) if os.path.isabs(xdg) else None
  except OSError:
    st = None
  if (st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
      and not st.st_mode & 0o077):
    return os.path.join(xdg, XDG_SUBDIR)
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return os.path.join(base, f"tfdp-{os.geteuid()}")


def local_worker_dir(root: str, worker: int) -> str:
  """Worker `worker`'s folder of the local tier at `root` (workers of one host share the root)."""
  return os.path.join(os.fspath(root).rstrip("/"), _WORKER_DIR.format(worker))


def peer_dir(worker_dir: str, source: int) -> str:
  """Where a worker keeps worker `source`'s per-worker states (inside its local folder)."""
  return os.path.join(worker_dir, _PEER_DIR.format(source))


def peer_copy_path(worker_dir: str, source: int, name: str, step: int) -> str:
  """The file of worker `source`'s per-worker state at `step`, kept in `worker_dir` (integers only)."""
  return os.path.join(peer_dir(worker_dir, int(source)), f"{name}-{int(step)}")


def peer_copy_step(filename: str, name: str) -> int | None:
  """The step of a kept per-worker state's file name, or None when it is not one (a temp file)."""
  prefix = name + "-"
  rest = filename[len(prefix):]
  return int(rest) if filename.startswith(prefix) and rest.isdigit() else None


def peer_sources(worker_dir: str) -> list[int]:
  """The workers whose per-worker states `worker_dir` holds (a local listing; no TF)."""
  prefix = _PEER_DIR.format("")
  names = os.listdir(worker_dir) if os.path.isdir(worker_dir) else []
  return sorted(int(n[len(prefix):]) for n in names
                if n.startswith(prefix) and n[len(prefix):].isdigit())


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

  @property
  def state_path(self) -> str:
    return os.path.join(self.directory, STATE_FILENAME)

  @property
  def logs_dir(self) -> str:
    """TensorBoard logs of the run (tfdp-train's, goodput's under `goodput/`)."""
    return os.path.join(self.directory, LOGS_DIRNAME)

  @property
  def goodput_dir(self) -> str:
    """The goodput ledger of the run: attempt records and per-worker progress files."""
    return os.path.join(self.directory, GOODPUT_DIRNAME)

  @property
  def keras_path(self) -> str:
    """The `.keras` file tfdp-train writes at the end of a run."""
    return os.path.join(self.directory, KERAS_FILENAME)

  def slot(self, index: int) -> str:
    """A local tier's slot file `index` (tfdp.checkpoint.local.slots): the bytes of one copy at a time."""
    return os.path.join(self.directory, f"{self.name}.slot-{int(index)}")

  def recovery_marker(self, step: int) -> str:
    """Written by every worker before a peer recovery of `step`, removed once it succeeded."""
    return os.path.join(self.directory, f"{RECOVERY_INFIX}{self.name}-{int(step)}.json")

  def recovery_steps(self) -> list[int]:
    """The steps of the recovery markers in the directory (a listing)."""
    head = f"{RECOVERY_INFIX}{self.name}-"
    names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
    return sorted(int(n[len(head):-5]) for n in names
                  if n.startswith(head) and n.endswith(".json") and n[len(head):-5].isdigit())

  def local(self, root: str | None, worker: int) -> "Layout":
    """The layout of worker `worker`'s local tier at `root` (None: the default root)."""
    root = root if root else default_local_root(self.directory)
    return Layout(local_worker_dir(root, worker), self.name)

  @staticmethod
  def marker_path(tmp_dir: str, worker: int) -> str:
    return os.path.join(tmp_dir, f"w{worker:05d}.done.json")

  @staticmethod
  def failed_path(tmp_dir: str) -> str:
    return os.path.join(tmp_dir, "FAILED.json")

  @staticmethod
  def shard_prefix(tmp_dir: str, worker: int, j: int) -> str:
    return os.path.join(tmp_dir, f"w{worker:05d}-{j:05d}")

  @staticmethod
  def is_workers(filename: str, worker: int) -> bool:
    """Whether temp-dir file `filename` is worker `worker`'s (its shards, its marker)."""
    return filename.startswith(f"w{worker:05d}")

  def parse(self, filename: str) -> FileName | None:
    """What `filename` (a basename) is, or None when it is not a checkpoint file."""
    name = ".+?" if self.name is None else re.escape(self.name)
    m = re.match(rf"^(?P<base>{name}-(?P<num>\d+))\.{_KIND_RE}$", filename)
    if not m:
      return None
    kind = next(k for k, p in _KIND_PATTERNS.items() if p.fullmatch(m.group("kind")))
    return FileName(m.group("base"), int(m.group("num")), kind)

  def is_checkpoint(self, base: str) -> bool:
    """Whether basename `base` (e.g. "ckpt-7") names a checkpoint of this layout."""
    return self.parse(os.path.basename(index_path(base))) is not None


_KIND_PATTERNS = {
    "index": re.compile(r"index"),
    "data": re.compile(r"data-\d+-of-\d+"),
    "manifest": re.compile(r"manifest\.json"),
    "manifest_tmp": re.compile(r"manifest\.json" + re.escape(ATOMIC_TMP_INFIX) + r"\d+"),
    "corrupt": re.compile(r"manifest\.json\.corrupt"),
    "tf_tmp": re.compile(r"(?:index|data-\d+-of-\d+)" + re.escape(TF_TMP_INFIX) + r"\d+"),
}
