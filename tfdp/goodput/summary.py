"""Goodput summaries: where a job's wall time went over all of its attempts, as goodput.json, a line and scalars."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

from tfdp.checkpoint.format import layout
from tfdp.goodput.ledger import write_json_atomic

# Name of the summary in the model directory, and the TensorBoard run of its scalars.
SUMMARY_FILE = layout.GOODPUT_FILENAME
SCALARS_DIR = os.path.join(layout.LOGS_DIRNAME, "goodput")

VERSION = 1


def reached(attempt: Mapping[str, Any]) -> Optional[int]:
  """The furthest step `attempt` reached: its progress files, heartbeats and record; None if none."""
  steps = [int(s) for s in list(attempt.get("progress_steps") or ())
           + list(attempt.get("heartbeat_steps") or ()) if s is not None and s >= 0]
  last = (attempt.get("record") or {}).get("last_step")
  if last is not None:
    steps.append(int(last))
  return max(steps) if steps else None


def _recomputed(rec, furthest, before):
  """Steps an attempt ran again: after its restored step, up to what an earlier attempt reached."""
  known = [int(h) for h in (before, rec.get("high_water")) if h is not None]
  if furthest is None or not known:
    return 0
  return max(0, min(furthest, max(known)) - int(rec.get("restored_step") or 0))


def _attempt_breakdown(a, next_spawn, end, before):
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
      "progress_steps": list(a.get("progress_steps") or []),
      "reached_step": reached(a),
      "restored_step": rec.get("restored_step"),
      "restored_tier": rec.get("restored_tier"),
      "restore_seconds": float(rec.get("restore_seconds") or 0.0),
      "local_every_steps": rec.get("local_every_steps"),
      "first_step": rec.get("first_step"), "last_step": rec.get("last_step"),
      "steps": int(rec.get("steps") or 0),
      "finished": bool(rec.get("finished")),
      "recomputed_steps": int(rec.get("recomputed_steps") or 0),
      "startup_seconds": wall, "productive_seconds": 0.0,
      "recomputed_seconds": 0.0, "blocked_seconds": blocked,
      "lost_seconds": 0.0, "other_seconds": 0.0,
      "gap_seconds": max(0.0, (next_spawn if next_spawn is not None else end) - stop),
  }
  if rec and "progress_steps" in a:
    # The workers' step counters make it exact: the steps after the restored
    # one, up to the furthest an earlier attempt reached.
    out["recomputed_steps"] = _recomputed(rec, out["reached_step"], before)
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
      step at the failure), `record` (the chief's `Recorder` record, or
      None when it wrote none) and, where the workers kept progress files,
      `progress_steps` (the step each reached). With `progress_steps` the
      recomputed steps of an attempt are exact: those after its restored
      step up to the furthest step an earlier attempt reached; without,
      they are its record's count.
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
    rows.append(_attempt_breakdown(a, next_spawn, end, high_water(attempts[:i])))
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
      "local_every_steps": last["local_every_steps"],
      "attempts": rows,
  }


def high_water(attempts: Sequence[Mapping[str, Any]]) -> Optional[int]:
  """The furthest step any of `attempts` reached (see `reached`).

  With the workers' progress files it is exact; from heartbeats and
  records alone, written a few times a second, it is a lower bound.

  Args:
    attempts: attempts as `summarize` takes them.

  Returns:
    The step, or None when no attempt reached one.
  """
  steps = [s for s in map(reached, attempts) if s is not None]
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
