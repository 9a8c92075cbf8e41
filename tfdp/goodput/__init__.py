"""Goodput accounting: where a run's wall time went, per attempt and summed over restarts and reruns, offline.

Owns: the Recorder a run keeps (here), the ledger in a run's directory
(ledger.py), the summaries over a job's attempts (summary.py). No TensorFlow.
May import: tfdp.checkpoint.format, tfdp.errors.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

from tfdp.goodput import ledger as ledger_lib
# The one JSON reader and atomic writer (tfdp.checkpoint.format.fs), as accounting uses them.
from tfdp.goodput.ledger import read_json, write_json_atomic
from tfdp.goodput.ledger import merge, progress_steps
from tfdp.goodput.summary import (SCALARS, SCALARS_DIR, SUMMARY_FILE, VERSION, high_water,
                                  reached, summarize, summary_line, write_scalars,
                                  write_summary)

__all__ = ["ENV_ATTEMPT_START", "ENV_FILE", "ENV_HIGH_WATER", "ENV_HISTORY",
           "ENV_RESTART_COUNT", "Recorder", "SCALARS", "SCALARS_DIR", "SUMMARY_FILE",
           "VERSION", "WRITE_INTERVAL", "high_water", "merge", "progress_steps",
           "reached", "read_json", "summarize", "summary_line", "write_json_atomic",
           "write_scalars", "write_summary"]

# This package is imported by tfdp-launch, which never imports TensorFlow: TF
# is imported only inside `write_scalars`, at the end of a worker's training.

# Environment that tfdp-launch sets for every worker of an attempt.
ENV_FILE = "TFDP_GOODPUT_FILE"              # the launcher's copy of the attempt's record
ENV_ATTEMPT_START = "TFDP_ATTEMPT_START"    # time.time() at the attempt's spawn
ENV_HIGH_WATER = "TFDP_GOODPUT_HIGH_WATER"  # highest step an earlier attempt reached
ENV_HISTORY = "TFDP_GOODPUT_HISTORY"        # JSON of the earlier attempts
ENV_RESTART_COUNT = "TFDP_RESTART_COUNT"    # the attempt number (procs sets it)

# A record is rewritten at most this often by `Recorder.step`.
WRITE_INTERVAL = 0.5

# The clock of every record (a test replaces it): wall time, as the launcher's.
_now = time.time

# Recorders made in this process so far: a later one (another `fit` after an
# interrupted one) is another attempt, which starts when it is made.
_made = 0


def _env_float(name):
  try:
    return float(os.environ[name])
  except (KeyError, ValueError):
    return None


def _env_int(name):
  value = _env_float(name)
  return None if value is None or not math.isfinite(value) else int(value)


def _worker_index():
  index = _env_int("TFDP_WORKER_INDEX")
  if index is None:
    try:
      index = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    except (KeyError, TypeError, ValueError):
      index = -1
  return index


def _key(attempt):
  return round(float(attempt["spawn"]), 6)


class Recorder:
  """This attempt's ledger of where its wall time went (written by the chief).

  The attempt's wall time is cut into: start-up (from the attempt's start
  until its first training step ended, which holds the restore and the
  first step's tracing), productive steps, recomputed steps and time
  blocked in checkpoint saves; what comes after the last step is left to
  `summarize`. Each step's time is the time since the previous `step` call,
  less what `blocked` reported in between.

  The ledger (`tfdp.goodput.ledger`) lives in `directory/.tfdp-goodput`:
  the chief rewrites this attempt's record there (at most every
  WRITE_INTERVAL seconds) and every worker keeps a progress file, an 8-byte
  step counter mapped into memory that each `step` updates without a system
  call and that survives a SIGKILL. So an attempt finds the attempts before
  it, whether tfdp-launch restarted it or the same command was run again,
  and the furthest step each reached.

  A step is recomputed when an earlier attempt had reached it already: it
  is after the restored step and at most the furthest step an earlier
  attempt reached (from the ledger, and $TFDP_GOODPUT_HIGH_WATER set by
  tfdp-launch). Recomputed steps count every such step; recomputed seconds
  count the time of those after the first step of the attempt, whose time
  is start-up.

  Args:
    directory: the run's model_dir (or backup dir): the ledger, goodput.json
      and logs/goodput go there; None (or a URL) keeps no ledger there.
    chief: only the chief records; another worker keeps its progress file.
    path: the launcher's copy of the record (default: $TFDP_GOODPUT_FILE,
      set by tfdp-launch); it also holds the earlier launches' attempts.
    tensorboard: write the `goodput/*` scalars at `finished` (it imports
      TensorFlow).
  """

  def __init__(self, directory: str | None, *, chief: bool = True,
               path: str | None = None, tensorboard: bool = True):
    global _made
    self.directory = directory
    self.chief = chief
    self.path = path if path is not None else (os.environ.get(ENV_FILE) or None)
    self.tensorboard = tensorboard
    self.start = _env_float(ENV_ATTEMPT_START)
    if self.start is None:
      self.start = (None if _made else ledger_lib.process_start_time()) or _now()
    _made += 1
    self._ledger = ledger_lib.Ledger.of(
        directory, fallback=os.path.dirname(self.path) if self.path else None)
    self._reopen = False  # finished() unmapped the progress file; a later step maps it again.
    self._progress = (self._ledger.progress(self.start, _worker_index())
                      if self._ledger else None)
    # The attempts before this one: the launcher's (this launch) and the
    # ledger's (this launch's and earlier ones'); `earlier` are the latter.
    self._history, self._found, self.earlier = [], [], []
    if chief:
      history = read_json(os.environ.get(ENV_HISTORY)) or {}
      self._history = list(history.get("attempts", []))
      if self._ledger:
        self._found = self._ledger.attempts(self.start, prune=True)
      launched = {_key(a) for a in self._history}
      self.earlier = [a for a in self._found if _key(a) not in launched]
    known = [h for h in (_env_int(ENV_HIGH_WATER), high_water(self._found)) if h is not None]
    self.high_water = max(known) if known else None
    self.record = {
        "version": VERSION,
        "attempt": (_env_int(ENV_RESTART_COUNT) or 0) + len(self.earlier),
        "directory": directory,
        "start": self.start,
        "high_water": self.high_water,
        "restored_step": None, "restored_tier": None, "restore_seconds": 0.0,
        "first_step": None, "first_step_time": None,
        "last_step": None, "last_step_time": None, "steps": 0,
        "startup_seconds": 0.0, "productive_seconds": 0.0,
        "recomputed_steps": 0, "recomputed_seconds": 0.0,
        "blocked_seconds": {},
        "finished": False, "finished_time": None, "final_step": None,
        "updated": None,
        # Whose it is: a rerun counts an attempt whose processes are gone.
        "pid": os.getpid(), "host": ledger_lib.host_id(),
        "process_start": ledger_lib.process_start_time(),
        "ledger": self._ledger.folder if self._ledger else None,
    }
    self._record_file = (self._ledger.record_path(self.start)
                         if chief and self._ledger else None)
    self._pending_blocked = 0.0  # blocked since the last step: not step time
    self._last_write = 0.0
    if self._record_file:
      self._write_ledger()

  def _write_now_and_then(self, now):
    if now - self._last_write >= WRITE_INTERVAL:
      self._write(now)

  def _write(self, now):
    self.record["updated"] = now
    self._last_write = now
    self._write_ledger()
    if self.path:
      try:
        write_json_atomic(self.path, dict(self.record, earlier=self.earlier))
      except OSError:
        pass  # accounting must never stop training

  def _write_ledger(self):
    if self._record_file:
      try:
        ledger_lib.write_json_atomic(self._record_file, self.record)  # The ledger's record.
      except OSError:
        pass

  def restored(self, step: int | None, seconds: float, tier: str | None = None) -> None:
    """Notes the restore: the step restored (None: a fresh start), its time and tier.

    Args:
      step: the global step of the checkpoint restored, or None.
      seconds: how long the restore took (it is part of start-up).
      tier: "local", "peer", "persistent", or None.
    """
    if not self.chief:
      return
    r = self.record
    r["restored_step"] = None if step is None else int(step)
    r["restored_tier"] = tier
    r["restore_seconds"] = max(0.0, float(seconds))
    self._write(_now())

  def step(self, step: int) -> None:
    """Notes that global step `step` ended; cheap enough for every step.

    Every worker stores `step` in its progress file (two stores into a
    mapped page): the furthest step is known exactly after any failure.
    The chief's record is rewritten (a small file, atomically) at most
    every WRITE_INTERVAL seconds by this and `blocked`, so a crash loses at
    most that much of it.

    Args:
      step: the global step just completed (the optimizer's iterations).
    """
    now = _now()
    if self._reopen:  # Training again after finished().
      self._reopen = False
      self._progress = self._ledger.progress(self.start, _worker_index())
    if self._progress is not None:
      self._progress.mark(step, now)
    if not self.chief:
      return
    r = self.record
    blocked, self._pending_blocked = self._pending_blocked, 0.0
    restored = r["restored_step"]
    recomputed = (self.high_water is not None and step <= self.high_water
                  and (restored is None or step > restored))
    if recomputed:
      r["recomputed_steps"] += 1
    if r["first_step"] is None:
      r["first_step"], r["first_step_time"] = step, now
      r["startup_seconds"] = max(0.0, now - self.start - blocked)
    else:
      seconds = max(0.0, now - r["last_step_time"] - blocked)
      r["recomputed_seconds" if recomputed else "productive_seconds"] += seconds
    r["last_step"], r["last_step_time"] = step, now
    r["steps"] += 1
    if r["steps"] == 1:
      self._write(now)  # where start-up ended, whatever comes next
    else:
      self._write_now_and_then(now)

  def blocked(self, seconds: float, tier: str) -> None:
    """Notes that training was blocked `seconds` in a checkpoint save of `tier`.

    Args:
      seconds: the time the training loop waited for the save.
      tier: "local" or "persistent".
    """
    if not self.chief:
      return
    seconds = max(0.0, float(seconds))
    per_tier = self.record["blocked_seconds"]
    per_tier[tier] = per_tier.get(tier, 0.0) + seconds
    self._pending_blocked += seconds
    self._write_now_and_then(_now())

  def interval(self, steps: int) -> None:
    """Notes the local saves' interval chosen now (with local_checkpoint_every_steps="auto")."""
    if self.chief and self.record.get("local_every_steps") != int(steps):
      self.record["local_every_steps"] = int(steps)
      self._write_now_and_then(_now())

  def finished(self, step: int) -> Optional[dict]:
    """Training is complete: the final record, the summary over every attempt, and TensorBoard.

    The summary covers the attempts in the ledger (earlier launches or
    reruns of the same command) and those tfdp-launch reported. Under
    tfdp-launch ($TFDP_GOODPUT_FILE set) it writes the final record (the
    launcher prints the goodput line and writes goodput.json when the job
    ends); otherwise it writes `directory/goodput.json` and prints the
    goodput line on stdout. Call it before the directory is deleted. With
    `tensorboard` it writes the summary as `goodput/*` scalars at `step`
    into `directory/logs/goodput`.

    Args:
      step: the final global step.

    Returns:
      The summary (see `summarize`), or None for a worker that is not the chief.
    """
    now = _now()
    progress, self._progress = self._progress, None
    self._reopen = progress is not None
    if progress is not None:
      progress.mark(int(step), now)
      progress.close()  # Unmapped: what it holds stays in the file.
    if not self.chief:
      return None
    r = self.record
    r["finished"], r["finished_time"], r["final_step"] = True, now, int(step)
    self._write(now)
    mine = {"attempt": r["attempt"], "spawn": self.start, "end": now, "failed": False,
            "heartbeat_steps": [], "record": r,
            "progress_steps": [int(step)] if progress is not None else []}
    summary = summarize(merge(self._found, self._history + [mine]), now)
    if not os.environ.get(ENV_FILE):
      if self.directory:
        write_summary(self.directory, summary)
      print(f"tfdp: {summary_line(summary)}", flush=True)
    if self.directory and self.tensorboard:
      write_scalars(self.directory, summary, int(step))
    return summary
