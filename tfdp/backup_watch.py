"""What BackupAndRestore checks and says of its backups: a backup_dir it cannot write, the interval "auto" chose, a data position that dominates."""

import os
import statistics
import tempfile
import time

from absl import logging

from tfdp import errors
from tfdp import resume as resume_lib
from tfdp.checkpoint import fs
from tfdp.checkpoint import local as local_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import policy


def check_writable(path: str) -> None:
  """Raises ConfigError when this process cannot create and write directory `path` (a scratch folder tells)."""
  fs.require_directory(path)
  if "://" in path:
    return  # Remote file systems say so at the first write.
  existing = os.path.abspath(path)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  try:
    if not os.path.isdir(existing):
      raise NotADirectoryError(f"{existing} is not a directory")
    os.rmdir(tempfile.mkdtemp(prefix=".tfdp-write-check-", dir=existing))
  except OSError as e:
    raise errors.ConfigError(
        f"BackupAndRestore cannot write backup_dir {path!r} ({e.strerror or e}): pass a "
        "directory this process can create and write, on storage every worker "
        "shares.") from None


class Watch:
  """What the chief says of the backups as training goes, once each: the interval "auto" chose, and their size."""

  def __init__(self):
    self.first_step = None  # The step this fit began at.
    self.window = None  # When the local tier measures (tfdp.checkpoint.local's window).
    self.interval = None
    self.last = None  # (time, step) of the last batch begin.
    self.step_seconds = []
    self.size_checked = False
    self.sparser_warned = False

  def train_begin(self, step: int) -> None:
    if self.window is None:
      self.first_step = step

  def batch_begin(self, backup, step: int) -> None:
    now = time.perf_counter()
    if self.last is not None and step > self.last[1]:
      self.step_seconds = (self.step_seconds + [(now - self.last[0]) / (step - self.last[1])])[-50:]
    self.last = (now, step)
    if not self.size_checked:
      self._check_size(backup)
    if backup.local_checkpoint_every_steps == "auto" and step != self.first_step:
      self._check_interval(backup, step)

  def _check_interval(self, backup, step: int) -> None:
    """After each of the local tier's measurements: its interval, when new; one warning if sparser than save_freq."""
    if self.window is None:  # The local tier's first save starts its window.
      self.window = policy.Cadence(policy.EveryNSteps(local_lib.AGREE_EVERY_STEPS))
      self.window.start(step)
      return
    interval = backup.manager.local_interval
    if not self.window.due(step) or interval == self.interval:
      return
    self.interval = interval
    costs = sorted(b + w for b, w in getattr(getattr(backup.manager, "_local", None), "costs", []))
    cost = f"{1e3 * costs[len(costs) // 2]:.1f} ms" if costs else "unknown"
    step_ms = 1e3 * statistics.median(self.step_seconds) if self.step_seconds else 0.0
    print(f"tfdp: local saves every {interval} step(s) (local_checkpoint_every_steps='auto': "
          f"a save costs {cost}, blocked plus its writer's CPU; a step {step_ms:.1f} ms; "
          f"checkpoint_overhead {backup.checkpoint_overhead:g})", flush=True)
    save_freq = backup.save_freq
    if (isinstance(save_freq, int) and not isinstance(save_freq, bool) and interval > save_freq
        and not self.sparser_warned):
      self.sparser_warned = True
      logging.warning(
          "tfdp: 'auto' saves the local tier every %d steps, less often than the backups "
          "(save_freq=%d): a local save costs %s against a budget of %g of %.1f ms steps, so "
          "a resume comes from the persistent tier. Make the state smaller (its data "
          "position above all), raise checkpoint_overhead, or pass "
          "local_checkpoint_every_steps=N.", interval, save_freq, cost,
          backup.checkpoint_overhead, step_ms)

  def _check_size(self, backup) -> None:
    """Once a backup is committed: one warning if the per-worker state (the data position) dominates it."""
    prefix = backup.manager.latest_checkpoint
    if not prefix:
      return
    self.size_checked = True  # TF's own checkpoints have no manifest: nothing to say of them.
    man = manifest_lib.read_manifest(prefix)
    if man is None:
      return
    per_worker = [int(w.get("per_worker_bytes", 0)) for w in man.writers.values()]
    if not man.total_bytes or sum(per_worker) <= 0.5 * man.total_bytes:
      return
    logging.warning(
        "tfdp: the data position is %s of each backup's %s (%s per worker, %s of "
        "variables): it holds the elements the input pipeline buffers (shuffle buffers, "
        "prefetched batches). To make it smaller, shuffle file names or indices before "
        "decoding (shuffle before map), use a smaller shuffle buffer, or tf.data's global "
        "shuffle where the source has random access; docs/data.md#state-size measures each.",
        f"{sum(per_worker) / man.total_bytes:.0%}", resume_lib.human_bytes(man.total_bytes),
        resume_lib.human_bytes(max(per_worker)),
        resume_lib.human_bytes(man.total_bytes - sum(per_worker)))
