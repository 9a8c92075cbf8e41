"""The goodput ledger kept in a run's directory: each attempt's record and each worker's step counter."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
import zlib
from typing import Any, Iterable, Mapping, Optional, Sequence

from tfdp.checkpoint.format import layout
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import private


def read_json(path: Optional[str]) -> Any:
  """fs.read_json, with a file that cannot be read taken as none: accounting never stops a run."""
  try:
    return fs.read_json(path)
  except OSError:
    return None


def write_json_atomic(path: str, obj) -> None:
  """fs.write_json_atomic without fsync: the records are rewritten every 0.5 s, often on NFS."""
  fs.write_json_atomic(path, obj, durable=False)

# A progress file is 64 bytes that its worker maps into memory. A step is two
# stores into that mapping (the step and its time): no system call, and the
# page cache keeps them when the process is SIGKILLed. In native byte order,
# as the mapping's stores: magic, step (-1 before the first), its time, the
# attempt's start, pid, the process's start, worker index (-1 unknown), host.
_FORMAT = "=8sqddqdqq"
_SIZE = struct.calcsize(_FORMAT)
_MAGIC = b"TFDPPRG1"
_STEP, _TIME = 1, 2  # indexes of the step (int64) and its time (float64) in the file

# Starts closer than this are the same attempt (a float that went through JSON).
_SAME_START = 1e-6


def _open_private(path: str, flags: int) -> int:
  """A ledger file: 0600, never through a symlink (tfdp.checkpoint.format.private's rule; the launcher loads no TF)."""
  return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def host_id() -> int:
  """A number for this host, stored with each file to tell whose processes can be checked."""
  return zlib.crc32(socket.gethostname().encode())


def process_start_time(pid: int | str = "self") -> Optional[float]:
  """When process `pid` started (time.time() scale), from /proc; None elsewhere or when gone."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      # The command name, in parentheses, may hold spaces: count after it.
      fields = f.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.time() - uptime + started_after_boot
  except (OSError, IndexError, ValueError):
    return None


def alive(pid: Optional[int], host: Optional[int], started: Optional[float]) -> bool:
  """Whether the process that wrote a ledger file still runs (known only on its own host).

  The calling process is never "alive": an earlier Recorder of this process
  is over once a new one starts.
  """
  if not pid or host != host_id() or pid == os.getpid():
    return False
  now_started = process_start_time(pid)
  # A pid reused by a later process started at another time.
  return now_started is not None and (not started or abs(now_started - started) < 2.0)


class Progress:
  """One worker's step counter in the ledger, updated by `mark` at every step for two memory stores.

  Args:
    path: the file (created, 64 bytes).
    start: the attempt's start (time.time()), which names the attempt.
    worker: the worker's index, or -1 when unknown.
  """

  def __init__(self, path: str, start: float, worker: int):
    self.path = path
    header = struct.pack(_FORMAT, _MAGIC, -1, 0.0, float(start), os.getpid(),
                         process_start_time() or 0.0, int(worker), host_id())
    with os.fdopen(_open_private(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), "w+b") as f:
      f.write(header)
      f.flush()
      self._map = mmap.mmap(f.fileno(), _SIZE)
    self._q = memoryview(self._map).cast("q")
    self._d = memoryview(self._map).cast("d")

  def mark(self, step: int, now: float) -> None:
    """Notes that step `step` ended at `now`: two stores into the shared mapping."""
    self._q[_STEP] = step
    self._d[_TIME] = now

  @property
  def step(self) -> int:
    return self._q[_STEP]

  def close(self) -> None:
    """Unmaps the file (what it holds stays in it); marks after this are an error."""
    if self._map is not None:
      self._q.release()
      self._d.release()
      self._map.close()
      self._map = None


def read_progress(path: str) -> Optional[dict]:
  """A progress file's content: step (None before the first), time, start, pid, worker, host; None if unreadable."""
  try:
    with open(path, "rb") as f:
      data = f.read(_SIZE)
    magic, step, t, start, pid, started, worker, host = struct.unpack(_FORMAT, data)
  except (OSError, struct.error):
    return None
  if magic != _MAGIC:
    return None
  return {"step": step if step >= 0 else None, "time": t if step >= 0 else None,
          "start": start, "pid": pid, "process_start": started, "worker": worker,
          "host": host, "path": path}


def _same(a: float, b: float) -> bool:
  return abs(float(a) - float(b)) < _SAME_START


class Ledger:
  """The ledger folder of a run: the chief's record of each attempt and every worker's progress file.

  It lives in the run's directory (`layout.GOODPUT_DIRNAME`), so that an
  attempt finds the attempts before it, whether tfdp-launch restarted it or
  the same command was run again. An attempt is named by its start: the
  time of the launcher's spawn (the same for every worker of an attempt) or,
  without the launcher, of each process's own start.

  Args:
    folder: the ledger folder (created when missing).
  """

  def __init__(self, folder: str):
    self.folder = folder
    private.make_dirs(folder, 0o700)  # Every folder it makes: a run directory made here holds the backups.

  @classmethod
  def of(cls, directory: Optional[str], fallback: Optional[str] = None) -> Optional["Ledger"]:
    """The ledger of run directory `directory`, else in `fallback`; None when neither can hold one.

    Args:
      directory: the run's directory; a URL cannot hold a ledger (this
        module imports no TensorFlow, whose file system reaches URLs).
      fallback: a local folder for the ledger otherwise (the launcher's).
    """
    if directory and "://" not in directory:
      folder = layout.Layout(directory).goodput_dir
    elif fallback:
      folder = fallback
    else:
      return None
    try:
      return cls(folder)
    except OSError:
      return None

  def record_path(self, start: float) -> str:
    return os.path.join(self.folder, layout.goodput_record_name(start, os.getpid()))

  def progress(self, start: float, worker: int) -> Optional[Progress]:
    """This process's progress file for the attempt that started at `start`; None if it cannot be made."""
    path = os.path.join(self.folder, layout.goodput_progress_name(start, os.getpid()))
    try:
      return Progress(path, start, worker)
    except (OSError, ValueError):
      return None

  def _records(self) -> list[dict]:
    records = []
    for name in _listdir(self.folder):
      if layout.is_goodput_record(name):
        r = read_json(os.path.join(self.folder, name))
        if isinstance(r, dict) and r.get("start") is not None:
          records.append(dict(r, _path=os.path.join(self.folder, name)))
    return sorted(records, key=lambda r: float(r["start"]))

  def attempts(self, until: float, prune: bool = False) -> list[dict]:
    """The attempts of this run that started before `until` and are over, as `summarize` takes them.

    The run begins after the newest finished attempt (a completed run;
    `prune` deletes its files and older ones). An attempt whose record is
    not finished and whose processes are gone failed: it ended at its last
    record or progress update, at the latest when the next one started.
    Each worker's progress file belongs to the attempt of the same start,
    else to the newest one that started before the worker's last step.

    Args:
      until: the start of the attempt that asks (it and later ones are left out).
      prune: delete the files of the completed runs before (the chief).

    Returns:
      Mappings with `attempt`, `spawn`, `end`, `failed` (True),
      `heartbeat_steps` ([]), `progress_steps` and `record`.
    """
    records = [r for r in self._records() if float(r["start"]) < until]
    # The asking attempt's workers (one start for all under tfdp-launch) may
    # have stepped already: their progress is not an earlier attempt's.
    progress = [p for p in _all_progress(self.folder)
                if float(p["start"]) < until and not _same(p["start"], until)]
    done = [i for i, r in enumerate(records) if r.get("finished")]
    if done:
      cut = records[done[-1]]
      if prune:
        self._prune(records[:done[-1] + 1], progress, cut)
      records = records[done[-1] + 1:]
      progress = [p for p in progress if (p["time"] or p["start"]) > float(
          cut.get("finished_time") or cut["start"])]
    steps = [[] for _ in records]
    times = [[] for _ in records]
    for p in progress:
      i = _owner(records, p)
      if i is not None and p["step"] is not None:
        steps[i].append(p["step"])
        times[i].append(p["time"])
    out = []
    for i, r in enumerate(records):
      if alive(r.get("pid"), r.get("host"), r.get("process_start")):
        continue  # not over: another job's (which the lease refuses), not a failure
      next_start = float(records[i + 1]["start"]) if i + 1 < len(records) else until
      last = max([t for t in [r.get("updated")] + times[i] if t is not None],
                 default=next_start)
      record = {k: v for k, v in r.items() if not k.startswith("_")}
      out.append({"attempt": len(out), "spawn": float(r["start"]),
                  "end": min(last, next_start), "failed": True, "heartbeat_steps": [],
                  "progress_steps": steps[i], "record": record})
    return out

  def _prune(self, records, progress, cut):
    """Deletes the records of a completed run and before, and the progress files of their time."""
    ended = float(cut.get("finished_time") or cut["start"])
    doomed = [r["_path"] for r in records]
    doomed += [p["path"] for p in progress if (p["time"] or p["start"]) <= ended
               and not alive(p["pid"], p["host"], p["process_start"])]
    for name in _listdir(self.folder):
      path = os.path.join(self.folder, name)
      if layout.ATOMIC_TMP_INFIX in name and _mtime(path) <= ended:
        doomed.append(path)  # a write that a kill cut short
    for path in doomed:
      try:
        os.remove(path)
      except OSError:
        pass


def _owner(records: Sequence[Mapping[str, Any]], p: Mapping[str, Any]) -> Optional[int]:
  """The index of the record that progress `p` belongs to, or None."""
  for i, r in enumerate(records):
    if _same(r["start"], p["start"]):
      return i
  if p["time"] is None:
    return None
  before = [i for i, r in enumerate(records) if float(r["start"]) <= p["time"]]
  return before[-1] if before else None


def _all_progress(folder):
  found = (read_progress(os.path.join(folder, n))
           for n in _listdir(folder) if layout.is_goodput_progress(n))
  return [p for p in found if p is not None]


def _listdir(folder):
  try:
    return os.listdir(folder)
  except OSError:
    return []


def _mtime(path):
  try:
    return os.path.getmtime(path)
  except OSError:
    return float("inf")


def progress_steps(folder: Optional[str], start: float) -> list[int]:
  """The steps the workers of the attempt that started at `start` reached, from `folder`'s progress files.

  Args:
    folder: a ledger folder (a record's `ledger`), or None.
    start: the attempt's start, as tfdp-launch gave it to its workers.

  Returns:
    One step per worker that completed a step.
  """
  if not folder:
    return []
  return [p["step"] for p in _all_progress(folder)
          if p["step"] is not None and _same(p["start"], start)]


def merge(found: Iterable[Mapping[str, Any]], known: Iterable[Mapping[str, Any]]) -> list[dict]:
  """Attempts read from a ledger and attempts a launcher saw, in order, numbered from 0.

  An attempt in both (the same spawn) is taken from `known`: the launcher
  knows when it spawned the workers and when it saw the failure. Each
  attempt ends at the latest when the next one spawned.

  Args:
    found: attempts as `Ledger.attempts` returns them.
    known: attempts as tfdp-launch keeps them.

  Returns:
    The attempts, as `summarize` takes them.
  """
  by_start = {}
  for a in list(found) + list(known):
    by_start[round(float(a["spawn"]), 6)] = a
  out = [dict(a, attempt=i) for i, a in enumerate(
      sorted(by_start.values(), key=lambda a: float(a["spawn"])))]
  for a, b in zip(out, out[1:]):
    if a.get("end") is None or float(a["end"]) > float(b["spawn"]):
      a["end"] = float(b["spawn"])
  return out
