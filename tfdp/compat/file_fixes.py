"""The fix of Keras's file writers under multi-worker (chief_only_files): the chief writes the paths the user gave, the others nowhere.

Every worker of a multi-worker job runs the same script: upstream, every one
of them writes `model.save`'s file, ModelCheckpoint's, CSVLogger's rows and
TensorBoard's events to the same paths (a CSV with every row twice, an event
file per worker). TF's multi-worker Keras tutorial has the chief write the
real path and the other workers a temporary directory that they remove; this
fix does that for them:
- `Model.save` and `Model.save_weights` (hence ModelCheckpoint and Keras's
  BackupAndRestore weights) on a worker other than the chief write into a
  temporary directory, removed when the call returns: the save runs as on
  the chief (whatever collectives reading the variables needs), and nothing
  reaches the user's path;
- `CSVLogger` on such a worker writes its rows to os.devnull;
- `TensorBoard` on such a worker logs into a temporary directory, removed at
  the end of training (and at exit).
Single-process runs (any strategy) are unchanged.
"""

import atexit
import functools
import os
import shutil
import tempfile

from keras.src.callbacks import csv_logger
from keras.src.callbacks import tensorboard
from keras.src.models import model as model_lib

from tfdp.distribute import cluster
from tfdp.compat import probes
from tfdp.compat.registry import patch_attr
from tfdp.compat.registry import register

_Model = model_lib.Model
_CSVLogger = csv_logger.CSVLogger
_TensorBoard = tensorboard.TensorBoard
_FIX = "chief_only_files"
SCRATCH_PREFIX = "tfdp-not-chief-"


def writes_nowhere(strategy) -> bool:
  """Whether this process is a worker other than the chief of a multi-worker job (which writes nothing of the user's)."""
  if strategy is None or not cluster.is_multi_worker(strategy):
    return False
  try:
    return not cluster.resolve(strategy).is_chief
  except Exception:  # pylint: disable=broad-except
    return False  # Not knowing who it is never stops a save.


def _scratch() -> str:
  folder = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
  atexit.register(shutil.rmtree, folder, True)
  return folder


def _wrap_save(original):
  """`Model.save`/`save_weights` that, on a worker other than the chief, writes into a temporary directory."""

  @functools.wraps(original)
  def method(self, filepath, *args, **kwargs):
    if not writes_nowhere(self.distribute_strategy):
      return original(self, filepath, *args, **kwargs)
    folder = _scratch()
    try:
      return original(self, os.path.join(folder, os.path.basename(os.fspath(filepath))),
                      *args, **kwargs)
    finally:
      shutil.rmtree(folder, ignore_errors=True)

  return method


def _wrap_csv_train_begin(original):
  """`CSVLogger.on_train_begin` that, on a worker other than the chief, opens os.devnull."""

  @functools.wraps(original)
  def on_train_begin(self, logs=None):
    model = getattr(self, "model", None)
    if not writes_nowhere(getattr(model, "distribute_strategy", None)):
      return original(self, logs)
    filename, self.filename = self.filename, os.devnull
    try:
      return original(self, logs)
    finally:
      self.filename = filename

  return on_train_begin


def _wrap_tensorboard_set_model(original):
  """`TensorBoard.set_model` that, on a worker other than the chief, logs into a temporary directory."""

  @functools.wraps(original)
  def set_model(self, model):
    if not writes_nowhere(getattr(model, "distribute_strategy", None)):
      return original(self, model)
    if getattr(self, "_tfdp_scratch", None) is None:
      self._tfdp_scratch = _scratch()
    log_dir, self.log_dir = self.log_dir, self._tfdp_scratch
    try:
      return original(self, model)
    finally:
      self.log_dir = log_dir

  return set_model


def _wrap_tensorboard_train_end(original):
  """`TensorBoard.on_train_end` that removes a non-chief's temporary directory after closing its writers."""

  @functools.wraps(original)
  def on_train_end(self, logs=None):
    try:
      return original(self, logs)
    finally:
      folder = getattr(self, "_tfdp_scratch", None)
      if folder is not None:
        self._tfdp_scratch = None
        shutil.rmtree(folder, ignore_errors=True)

  return on_train_end


def _probe_chief_only_files():
  return [
      *probes.defines(_Model, "save", "save_weights", own=True),
      *probes.params(_Model, "save", ("self", "filepath")),
      *probes.params(_Model, "save_weights", ("self", "filepath")),
      *probes.reads(_Model, "save", "saving_api.save_model(", "self, filepath"),
      *probes.reads(_Model, "save_weights", "saving_api.save_weights(", "self, filepath"),
      *probes.defines(_CSVLogger, "on_train_begin", own=True),
      *probes.reads(_CSVLogger, "__init__", "self.filename = "),
      *probes.reads(_CSVLogger, "on_train_begin", "file_utils.exists(self.filename)",
                    "self.csv_file = file_utils.File(self.filename, mode)", ordered=True),
      *probes.defines(_TensorBoard, "set_model", "on_train_end", own=True),
      *probes.reads(_TensorBoard, "set_model", "self._log_write_dir = self.log_dir",
                    'os.path.join(self._log_write_dir, "train")',
                    'os.path.join(self._log_write_dir, "validation")', ordered=True),
      *probes.reads(_TensorBoard, "on_train_end", "self._close_writers()"),
      *probes.multi_worker_attributes(),
  ]


@register(_FIX, _probe_chief_only_files,
          "every worker of a multi-worker job writes model.save's and ModelCheckpoint's "
          "files, CSVLogger's rows and TensorBoard's events to the same paths")
def _install_chief_only_files():
  """keras/src/models/model.py Model.save, save_weights; keras/src/callbacks csv_logger.py, tensorboard.py.

  Upstream, every worker of a multi-worker job writes the paths the user
  gave: the chief's file and the others' race, CSVLogger's rows are there
  once per worker, TensorBoard holds an event file per worker. Under
  multi-worker MultiWorkerMirroredStrategy the patch has workers other than
  the chief save models into a temporary directory they remove at once,
  CSVLogger write to os.devnull and TensorBoard log into a temporary
  directory removed at the end of training; the chief writes the user's
  paths. Other strategies go to upstream.
  """
  undo = [
      patch_attr(_Model, "save", _wrap_save(_Model.__dict__["save"]), _FIX),
      patch_attr(_Model, "save_weights", _wrap_save(_Model.__dict__["save_weights"]), _FIX),
      patch_attr(_CSVLogger, "on_train_begin",
                 _wrap_csv_train_begin(_CSVLogger.__dict__["on_train_begin"]), _FIX),
      patch_attr(_TensorBoard, "set_model",
                 _wrap_tensorboard_set_model(_TensorBoard.__dict__["set_model"]), _FIX),
      patch_attr(_TensorBoard, "on_train_end",
                 _wrap_tensorboard_train_end(_TensorBoard.__dict__["on_train_end"]), _FIX),
  ]
  return lambda: [u() for u in reversed(undo)]
