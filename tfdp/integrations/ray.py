"""Ray Train: a Keras callback that tells Ray about each committed tfdp backup (metrics and a pointer checkpoint)."""

import os
import tempfile
import time
from typing import Optional

import keras

from tfdp import errors
from tfdp import goodput
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout

POINTER = "tfdp_backup.json"


class ReportCheckpoints(keras.callbacks.Callback):
  """Reports each backup that `backup` (a tfdp BackupAndRestore) committed to Ray Train.

  Put it after the BackupAndRestore in `fit`'s callbacks, inside Ray's
  `train_loop_per_worker`. After each backup save (the same steps on every
  worker, as `ray.train.report` needs: it is a barrier), every worker calls
  `ray.train.report` with the logs of that step plus `step`; the chief adds
  a checkpoint that points at the backup: a directory holding one small
  file, `tfdp_backup.json` (`backup_dir`, `prefix`, `step`), so Ray's
  `Result.checkpoint` names tfdp's newest backup. It is a pointer and not the
  checkpoint's files because Ray registers a checkpoint only as a directory
  of its own inside the run's storage, copied there unless already there;
  a tfdp backup is files in the backup directory beside the older ones and
  the local tier's copies, which Ray would copy (and, with its num_to_keep,
  delete) a second time. Read it back with `backup_of(result.checkpoint)`.
  The backup directory must outlive the run for the pointer to lead
  somewhere: pass BackupAndRestore(delete_checkpoint=False).

  Args:
    backup: the BackupAndRestore callback of the same fit.
  """

  def __init__(self, backup):
    super().__init__()
    self.backup = backup
    self._reported = None

  def on_train_batch_end(self, batch, logs=None):
    self._report_if_saved(logs)

  def on_epoch_end(self, epoch, logs=None):
    self._report_if_saved(logs)

  def _report_if_saved(self, logs):
    manager = self.backup.manager
    step = None if manager is None else manager.last_saved_step
    if step is None or step == self._reported:
      return
    self._reported = step
    import ray.train  # pylint: disable=g-import-not-at-top
    manager.sync()  # An async save commits first: the pointer names a committed backup.
    metrics = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
    metrics["step"] = int(step)
    prefix = manager.latest_checkpoint
    if not manager.is_chief or prefix is None:
      ray.train.report(metrics)
      return
    with tempfile.TemporaryDirectory() as pointer_dir:
      fs.write_json_atomic(os.path.join(pointer_dir, POINTER),
                           {"backup_dir": self.backup.backup_dir, "prefix": prefix,
                            "step": int(step)})
      ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(pointer_dir))


def _is_number(value) -> bool:
  try:
    float(value)
  except (TypeError, ValueError):
    return False
  return True


def backup_of(checkpoint) -> dict:
  """What a ReportCheckpoints pointer (a `ray.train.Checkpoint`, e.g. `Result.checkpoint`) names.

  Returns:
    {"backup_dir": ..., "prefix": ..., "step": ...}: the backup directory
    to pass to BackupAndRestore (or tfdp-ckpt), and the checkpoint in it.

  Raises:
    CheckpointError: the checkpoint is not one ReportCheckpoints reported.
  """
  with checkpoint.as_directory() as directory:
    pointer = fs.read_json(os.path.join(directory, POINTER))
    if pointer is None:
      raise errors.CheckpointError(
          f"{checkpoint} holds no {POINTER}: it was not reported by "
          "tfdp.integrations.ray.ReportCheckpoints.")
    return pointer


def goodput_summary(backup_dir: str) -> Optional[str]:
  """The goodput line over a Ray run's attempts, as tfdp-launch prints it, read from `backup_dir`.

  Call it on the Ray driver after `trainer.fit()` (or after it raised):
  Ray's attempts are the attempts tfdp's ledger in the backup directory
  recorded, one per restart of the group. A run that finished wrote
  `goodput.json` there (its chief's summary over all attempts); a run Ray
  gave up on (more failures than `max_failures`) left only the ledger's
  records, which are summed here the same way. Needs a local (or mounted)
  backup directory: the ledger is kept only there.

  Args:
    backup_dir: the BackupAndRestore's backup_dir.

  Returns:
    `goodput P%: N restarts (S s), K steps recomputed (S s), ...`, or None
    when the directory holds no record of a run.
  """
  ledger = layout.Layout(backup_dir).goodput_dir
  # Attempts after the newest finished one: a run Ray gave up on, newer than any goodput.json.
  failed = goodput.ledger.Ledger(ledger).attempts(time.time()) if os.path.isdir(ledger) else []
  summary = (goodput.summarize(failed, max(a["end"] for a in failed)) if failed
             else goodput.read_json(os.path.join(backup_dir, goodput.SUMMARY_FILE)))
  return goodput.summary_line(summary) if summary else None
