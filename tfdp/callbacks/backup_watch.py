"""What BackupAndRestore checks and says of its backups: a backup_dir it cannot write, the interval "auto" chose, a data position that dominates."""

import os
import tempfile

from absl import logging

from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import units

# A data position smaller than this per worker costs a save too little to
# warn about, however much of the (small) backup it is.
DOMINANT_MIN_BYTES = 1 << 20


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
  """What the chief says of the backups as training goes: the interval "auto" chose (tfdp.checkpoint.schedule.policy.LocalCadence measures it), and their size."""

  def __init__(self):
    self.tuning = None  # The local tier's measurement said last.
    self.size_checked = False
    self.sparser_warned = False

  def batch_begin(self, backup) -> None:
    if not self.size_checked:
      self._check_size(backup)
    tuning = backup.manager.local_tuning
    if tuning is not None and tuning is not self.tuning:
      self.tuning = tuning
      self._say_interval(backup, tuning)

  def _say_interval(self, backup, tuning) -> None:
    """The local tier's new interval; one warning if it is sparser than save_freq."""
    print(f"tfdp: {tuning.describe()}", flush=True)
    save_freq = backup.save_freq
    if (isinstance(save_freq, int) and not isinstance(save_freq, bool)
        and tuning.interval > save_freq and not self.sparser_warned):
      self.sparser_warned = True
      logging.warning(
          "tfdp: 'auto' saves the local tier every %d steps, less often than the backups "
          "(save_freq=%d): a local save costs %s against a budget of %g of %.1f ms steps, so "
          "a resume comes from the persistent tier. Make the state smaller (its data "
          "position above all), raise checkpoint_overhead, or pass "
          "local_checkpoint_every_steps=N.", tuning.interval, save_freq, tuning.cost_text,
          tuning.budget, 1e3 * tuning.step_seconds)

  def _check_size(self, backup) -> None:
    """Once a backup is committed: one warning if the per-worker state (the data position) dominates it and is 1 MB or more."""
    prefix = backup.manager.latest_checkpoint
    if not prefix:
      return
    self.size_checked = True  # TF's own checkpoints have no manifest: nothing to say of them.
    man = manifest_lib.read_manifest(prefix)
    if man is None:
      return
    per_worker = [int(w.get("per_worker_bytes", 0)) for w in man.writers.values()]
    if (not man.total_bytes or sum(per_worker) <= 0.5 * man.total_bytes
        or max(per_worker) < DOMINANT_MIN_BYTES):
      return
    logging.warning(
        "tfdp: the data position is %s of each backup's %s (%s per worker, %s of "
        "variables): it holds the elements the input pipeline buffers (shuffle buffers, "
        "prefetched batches). To make it smaller, shuffle file names or indices before "
        "decoding (shuffle before map), use a smaller shuffle buffer, or tf.data's global "
        "shuffle where the source has random access; docs/data.md#state-size measures each.",
        f"{sum(per_worker) / man.total_bytes:.0%}", units.human_bytes(man.total_bytes),
        units.human_bytes(max(per_worker)),
        units.human_bytes(man.total_bytes - sum(per_worker)))


def why_no_hooks() -> str | None:
  """Why `fit` runs without tfdp's data hooks (tfdp.compat's fit_data_state not installed), or None.

  Asked here, as tfdp.resume may not import tfdp.compat (compat imports it).
  """
  from tfdp import compat  # pylint: disable=g-import-not-at-top
  name = "fit_data_state"
  if name in compat.applied():
    return None
  if name in compat.skipped():
    return f"tfdp.compat did not install {name}: {compat.skipped()[name]}"
  if name in compat.disabled_fixes():
    return f"tfdp.compat's {name} is disabled by {compat.DISABLE_ENV}"
  return f"tfdp.compat's {name} is not installed (import tfdp before fit)"
