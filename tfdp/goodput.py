"""Goodput accounting: where a run's wall time went, per attempt and summed over restarts, offline."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping, Optional, Sequence

from tfdp.checkpoint import layout

# This module is imported by tfdp-launch, which never imports TensorFlow: TF
# is imported only inside `write_scalars`, at the end of a worker's training.

# Environment that tfdp-launch sets for every worker of an attempt.
ENV_FILE = "TFDP_GOODPUT_FILE"              # the attempt's record (chief writes)
ENV_ATTEMPT_START = "TFDP_ATTEMPT_START"    # time.time() at the attempt's spawn
ENV_HIGH_WATER = "TFDP_GOODPUT_HIGH_WATER"  # highest step an earlier attempt reached
ENV_HISTORY = "TFDP_GOODPUT_HISTORY"        # JSON of the earlier attempts
ENV_RESTART_COUNT = "TFDP_RESTART_COUNT"    # the attempt number (procs sets it)

# Name of the summary in the model directory, and the TensorBoard run of its scalars.
SUMMARY_FILE = layout.GOODPUT_FILENAME
SCALARS_DIR = os.path.join(layout.LOGS_DIRNAME, "goodput")

# A record is rewritten at most this often by `Recorder.step`.
WRITE_INTERVAL = 0.5

VERSION = 1

# The clock of every record (a test replaces it): wall time, as the launcher's.
_now = time.time


def read_json(path: Optional[str]) -> Any:
  """The JSON in `path`; None when there is no path or file, or it is incomplete."""
  if not path:
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes `obj` as JSON to `path`: a reader sees all of it or the old file (temp, rename)."""
  tmp = layout.atomic_tmp_path(path)
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def _process_start_time() -> Optional[float]:
  """When this process started (time.time() scale), from /proc; None elsewhere."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      # The command name, in parentheses, may hold spaces: count after it.
      fields = f.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return None
  return time.time() - uptime + started_after_boot


def _env_float(name):
  try:
    return float(os.environ[name])
  except (KeyError, ValueError):
    return None


def _env_int(name):
  value = _env_float(name)
  return None if value is None or not math.isfinite(value) else int(value)


class Recorder:
  """This attempt's ledger of where its wall time went (written by the chief).

  The attempt's wall time is cut into: start-up (from the attempt's start
  until its first training step ended, which holds the restore and the
  first step's tracing), productive steps, recomputed steps and time
  blocked in checkpoint saves; what comes after the last step is left to
  `summarize`. Each step's time is the time since the previous `step` call,
  less what `blocked` reported in between.

  A step is recomputed when an earlier attempt had reached it already: it
  is after the restored step and at most $TFDP_GOODPUT_HIGH_WATER (set by
  tfdp-launch). Recomputed steps count every such step; recomputed seconds
  count the time of those after the first step of the attempt, whose time
  is start-up.

  Args:
    directory: the run's model_dir (or backup dir): goodput.json and
      logs/goodput go there; None writes neither.
    chief: only the chief records; the Recorder of another worker does nothing.
    path: the record file (default: $TFDP_GOODPUT_FILE, set by tfdp-launch);
      without one nothing is written while training runs.
    tensorboard: write the `goodput/*` scalars at `finished` (it imports
      TensorFlow).
  """

  def __init__(self, directory: str | None, *, chief: bool = True,
               path: str | None = None, tensorboard: bool = True):
    self.directory = directory
    self.chief = chief
    self.path = path if path is not None else (os.environ.get(ENV_FILE) or None)
    self.tensorboard = tensorboard
    self.start = (_env_float(ENV_ATTEMPT_START) or _process_start_time()
                  or _now())
    self.high_water = _env_int(ENV_HIGH_WATER)
    self.record = {
        "version": VERSION,
        "attempt": _env_int(ENV_RESTART_COUNT) or 0,
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
    }
    self._pending_blocked = 0.0  # blocked since the last step: not step time
    self._last_write = 0.0

  def _write_now_and_then(self, now):
    if now - self._last_write >= WRITE_INTERVAL:
      self._write(now)

  def _write(self, now):
    if not self.path:
      return
    self.record["updated"] = now
    self._last_write = now
    try:
      write_json_atomic(self.path, self.record)
    except OSError:
      pass  # accounting must never stop training

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

    The record is rewritten (a small file, atomically) at most every
    WRITE_INTERVAL seconds by this and `blocked`, so a crash loses at most
    that much of it; the launcher's heartbeat step fills in the high water.

    Args:
      step: the global step just completed (the optimizer's iterations).
    """
    if not self.chief:
      return
    now = _now()
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

  def finished(self, step: int) -> Optional[dict]:
    """Training is complete: the final record, goodput.json or the launcher's, and TensorBoard.

    Under tfdp-launch ($TFDP_GOODPUT_FILE set) it writes the final record
    (the launcher writes goodput.json when the job ends); otherwise it
    writes `directory/goodput.json` for this one attempt. With `tensorboard`
    it writes the summary over every attempt so far as `goodput/*` scalars
    at `step` into `directory/logs/goodput`.

    Args:
      step: the final global step.

    Returns:
      The summary (see `summarize`), or None for a worker that is not the chief.
    """
    if not self.chief:
      return None
    now = _now()
    r = self.record
    r["finished"], r["finished_time"], r["final_step"] = True, now, int(step)
    self._write(now)
    history = read_json(os.environ.get(ENV_HISTORY)) or {}
    attempts = list(history.get("attempts", []))
    attempts.append({"attempt": r["attempt"], "spawn": self.start, "end": now,
                     "failed": False, "heartbeat_steps": [], "record": r})
    summary = summarize(attempts, now)
    if self.directory and not os.environ.get(ENV_FILE):
      write_summary(self.directory, summary)
    if self.directory and self.tensorboard:
      write_scalars(self.directory, summary, int(step))
    return summary


def _attempt_breakdown(a, next_spawn, end):
  """One attempt's seconds, which add up to its wall time plus the gap until `next_spawn`."""
  spawn = float(a["spawn"])
  stop = float(a.get("end") or end)
  wall = max(0.0, stop - spawn)
  rec = a.get("record") or {}
  blocked = {t: float(s) for t, s in (rec.get("blocked_seconds") or {}).items()}
  out = {
      "attempt": int(a.get("attempt", rec.get("attempt", 0))),
      "spawn": spawn, "end": stop, "wall_seconds": wall,
      "failed": bool(a.get("failed")), "has_record": bool(rec),
      "heartbeat_steps": list(a.get("heartbeat_steps") or []),
      "restored_step": rec.get("restored_step"),
      "restored_tier": rec.get("restored_tier"),
      "restore_seconds": float(rec.get("restore_seconds") or 0.0),
      "first_step": rec.get("first_step"), "last_step": rec.get("last_step"),
      "steps": int(rec.get("steps") or 0),
      "finished": bool(rec.get("finished")),
      "recomputed_steps": int(rec.get("recomputed_steps") or 0),
      "startup_seconds": wall, "productive_seconds": 0.0,
      "recomputed_seconds": 0.0, "blocked_seconds": blocked,
      "lost_seconds": 0.0, "other_seconds": 0.0,
      "gap_seconds": max(0.0, (next_spawn if next_spawn is not None else end) - stop),
  }
  if rec.get("first_step_time") is None:
    # No step ended (a crash in start-up, or no record at all): all start-up,
    # save what a record says was blocked in a save.
    out["startup_seconds"] = max(0.0, wall - sum(blocked.values()))
    return out
  parts = {k: float(rec.get(k) or 0.0)
           for k in ("startup_seconds", "productive_seconds", "recomputed_seconds")}
  rest = wall - sum(parts.values()) - sum(blocked.values())
  if rest < 0:  # a record written after the launcher saw the failure: trim its steps
    parts["productive_seconds"] = max(0.0, parts["productive_seconds"] + rest)
    rest = 0.0
  out.update(parts)
  # After the last recorded step: lost to the failure, or the end of a good run.
  out["lost_seconds" if out["failed"] else "other_seconds"] = max(0.0, rest)
  return out


def summarize(attempts: Sequence[Mapping[str, Any]], end: float) -> dict:
  """Where a job's wall time went, over all of its attempts: the content of goodput.json.

  The wall time, from the first attempt's spawn to `end`, is cut into
  productive, start-up (with restore), recomputed, checkpoint-blocked,
  restart and other seconds, which add up to it. Restart seconds are, per
  failed attempt, the time after its last recorded step (unrecorded steps,
  the failure, its detection) plus the gap until the next spawn (stopping
  the group); the next attempt's start-up is counted as start-up.

  Args:
    attempts: in order, one mapping per attempt: `attempt`, `spawn` and `end`
      (time.time() when it started and ended, or the failure was
      detected), `failed`, `heartbeat_steps` (each worker's last heartbeat
      step at the failure) and `record` (the chief's `Recorder` record, or
      None when it wrote none).
    end: time.time() at the end of the job.

  Returns:
    A JSON-able dict: `percent` (productive / wall), `wall_seconds`,
    `productive_seconds`, `startup_seconds`, `restore_seconds`, `restarts`,
    `restart_seconds`, `recomputed_steps`, `recomputed_seconds`,
    `checkpoint_blocked_seconds` (and `blocked_seconds` per tier),
    `other_seconds`, `finished`, `directory` and `attempts` (the breakdown
    of each).
  """
  if not attempts:
    raise ValueError("summarize needs at least one attempt")
  rows = []
  for i, a in enumerate(attempts):
    next_spawn = float(attempts[i + 1]["spawn"]) if i + 1 < len(attempts) else None
    rows.append(_attempt_breakdown(a, next_spawn, end))
  start = rows[0]["spawn"]
  wall = max(0.0, end - start)
  blocked = {}
  for row in rows:
    for tier, seconds in row["blocked_seconds"].items():
      blocked[tier] = blocked.get(tier, 0.0) + seconds
  last = rows[-1]
  restart = sum(r["lost_seconds"] + r["gap_seconds"] for r in rows[:-1])
  restart += last["lost_seconds"]
  productive = sum(r["productive_seconds"] for r in rows)
  directories = [a["record"].get("directory") for a in attempts if a.get("record")]
  return {
      "version": VERSION,
      "directory": next((d for d in reversed(directories) if d), None),
      "start": start, "end": end, "wall_seconds": wall,
      "percent": 100.0 * productive / wall if wall > 0 else 0.0,
      "productive_seconds": productive,
      "startup_seconds": sum(r["startup_seconds"] for r in rows),
      "restore_seconds": sum(r["restore_seconds"] for r in rows),
      "restarts": len(rows) - 1,
      "restart_seconds": restart,
      "recomputed_steps": sum(r["recomputed_steps"] for r in rows),
      "recomputed_seconds": sum(r["recomputed_seconds"] for r in rows),
      "checkpoint_blocked_seconds": sum(blocked.values()),
      "blocked_seconds": blocked,
      "other_seconds": sum(r["other_seconds"] for r in rows) + last["gap_seconds"],
      "finished": last["finished"],
      "final_step": (attempts[-1].get("record") or {}).get("final_step"),
      "attempts": rows,
  }


def high_water(attempts: Sequence[Mapping[str, Any]]) -> Optional[int]:
  """The highest step any of `attempts` reached: its heartbeats at the failure and its record.

  Both are written a few times a second, not every step, so this is a lower
  bound of the true step at the failure.

  Args:
    attempts: attempts as `summarize` takes them.

  Returns:
    The step, or None when no attempt reached one.
  """
  steps = []
  for a in attempts:
    steps += [s for s in a.get("heartbeat_steps") or () if s is not None and s >= 0]
    last = (a.get("record") or {}).get("last_step")
    if last is not None:
      steps.append(int(last))
  return max(steps) if steps else None


def _seconds(x):
  return f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def summary_line(summary: Mapping[str, Any]) -> str:
  """The one-line summary, e.g. `goodput 96.8%: 2 restarts (14 s), 40 steps recomputed (9 s), ...`.

  Args:
    summary: what `summarize` returned.

  Returns:
    `goodput P%: N restart(s) (S s), K steps recomputed (S s), checkpoints
    blocked S s, start-up S s (restore S s), wall S s`.
  """
  s = summary
  restarts = s["restarts"]
  return (f"goodput {s['percent']:.1f}%: {restarts} restart{'' if restarts == 1 else 's'} "
          f"({_seconds(s['restart_seconds'])}), {s['recomputed_steps']} steps recomputed "
          f"({_seconds(s['recomputed_seconds'])}), checkpoints blocked "
          f"{_seconds(s['checkpoint_blocked_seconds'])}, start-up "
          f"{_seconds(s['startup_seconds'])} (restore {_seconds(s['restore_seconds'])}), "
          f"wall {_seconds(s['wall_seconds'])}")


def write_summary(directory: str, summary: Mapping[str, Any]) -> Optional[str]:
  """Writes `summary` to `directory/goodput.json` atomically; skips a directory that is gone.

  Args:
    directory: a local directory (the model_dir); a URL or a missing
      directory is skipped (this writer imports no TensorFlow).
    summary: what `summarize` returned.

  Returns:
    The path written, or None when skipped.
  """
  if not directory or not os.path.isdir(directory):
    return None
  path = os.path.join(directory, SUMMARY_FILE)
  try:
    write_json_atomic(path, summary)
  except OSError:
    return None
  return path


# The TensorBoard scalars: tag -> key of the summary.
SCALARS = {
    "goodput/percent": "percent",
    "goodput/restarts": "restarts",
    "goodput/recomputed_steps": "recomputed_steps",
    "goodput/recomputed_seconds": "recomputed_seconds",
    "goodput/checkpoint_blocked_seconds": "checkpoint_blocked_seconds",
    "goodput/restart_seconds": "restart_seconds",
    "goodput/startup_seconds": "startup_seconds",
}


def write_scalars(directory: str, summary: Mapping[str, Any], step: int) -> None:
  """Writes the `goodput/*` scalars of `summary` at `step` into `directory/logs/goodput`.

  Args:
    directory: the model_dir (any path tf.summary can write).
    summary: what `summarize` returned.
    step: the global step to write them at (the final one).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  # workers only
  writer = tf.summary.create_file_writer(os.path.join(directory, SCALARS_DIR))
  try:
    with writer.as_default():
      for tag, key in SCALARS.items():
        tf.summary.scalar(tag, float(summary[key]), step=step)
    writer.flush()
  finally:
    writer.close()
