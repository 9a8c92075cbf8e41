"""tfdp.callbacks.BackupAndRestore against keras.callbacks.BackupAndRestore: the same scenarios, the same results."""

import os

import keras
import numpy as np
import pytest

from tfdp import callbacks

KINDS = ("keras", "tfdp")
X = np.random.RandomState(0).normal(size=(40, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)
BATCH = 8  # 5 steps an epoch


def _callback(kind, backup_dir, **kw):
  cls = keras.callbacks.BackupAndRestore if kind == "keras" else callbacks.BackupAndRestore
  return cls(backup_dir, **kw)


def _model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(keras.optimizers.SGD(0.01), "mse")
  return model


class _Interrupt(keras.callbacks.Callback):
  """Raises at the start of epoch `epoch`, or after global batch `batch` of it."""

  def __init__(self, epoch, batch=None):
    super().__init__()
    self.epoch, self.batch, self._current = epoch, batch, None

  def on_epoch_begin(self, epoch, logs=None):
    self._current = epoch
    if epoch == self.epoch and self.batch is None:
      raise RuntimeError("Interrupting!")

  def on_train_batch_end(self, batch, logs=None):
    if self._current == self.epoch and batch == self.batch:
      raise RuntimeError("Interrupting!")


def _fit(model, cbs, epochs=10):
  return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                   callbacks=cbs)


def _scenario(kind, tmp_path, *, fresh_callback, interrupt, **kw):
  """Keras's docstring pattern: fit interrupted, then fit again. Returns what a user sees."""
  backup_dir = str(tmp_path / kind)
  model = _model()
  cb = _callback(kind, backup_dir, **kw)
  with pytest.raises(RuntimeError, match="Interrupting"):
    _fit(model, [cb, interrupt])
  existed = os.path.isdir(backup_dir)
  if fresh_callback:
    cb = _callback(kind, backup_dir, **kw)
  history = _fit(model, [cb])
  return {"epochs_run": history.epoch, "existed_after_interrupt": existed,
          "exists_at_end": os.path.isdir(backup_dir),
          "weights": [w.tobytes() for w in model.get_weights()]}


@pytest.mark.parametrize("fresh_callback", [False, True])
@pytest.mark.parametrize("case", [
    dict(interrupt=(4, None), resumes_at=4),                  # at an epoch boundary
    dict(interrupt=(4, 2), resumes_at=4),                     # mid-epoch, epoch backups
    dict(interrupt=(4, None), resumes_at=4, delete_checkpoint=False),
    dict(interrupt=(3, None), resumes_at=3, double_checkpoint=True),
    # Every 5 steps: step 10 is the second epoch's last. Keras's backup at
    # that batch precedes the epoch's end, and it reruns the epoch. tfdp's
    # waits for the end of the epoch (after its validation and the other
    # callbacks' epoch end) and holds the data position, so the run goes on
    # at the third epoch and ends bitwise equal to an uninterrupted run.
    dict(interrupt=(2, None), resumes_at=2, keras_resumes_at=1, save_freq=5),
])
def test_interrupted_fit_resumes_like_keras(tmp_path, case, fresh_callback):
  case = dict(case)
  epoch, batch = case.pop("interrupt")
  resumes_at = case.pop("resumes_at")
  keras_resumes_at = case.pop("keras_resumes_at", resumes_at)
  results = {kind: _scenario(kind, tmp_path, fresh_callback=fresh_callback,
                             interrupt=_Interrupt(epoch, batch), **case) for kind in KINDS}
  assert results["tfdp"]["epochs_run"] == list(range(resumes_at, 10))
  assert results["keras"]["epochs_run"] == list(range(keras_resumes_at, 10))
  if "save_freq" not in case:
    assert results["tfdp"] == results["keras"]
    return
  tfdp_weights = results["tfdp"].pop("weights")
  keras_weights = results["keras"].pop("weights")
  for r in results.values():
    r.pop("epochs_run")
  assert results["tfdp"] == results["keras"]
  model = _model()
  _fit(model, [])
  uninterrupted = [w.tobytes() for w in model.get_weights()]
  assert tfdp_weights == uninterrupted
  assert keras_weights != uninterrupted  # it trained on epoch 1's batches twice


def test_completed_fit_deletes_or_keeps_like_keras(tmp_path):
  for delete in (True, False):
    seen = {}
    for kind in KINDS:
      backup_dir = str(tmp_path / f"{kind}-{delete}")
      model = _model()
      history = _fit(model, [_callback(kind, backup_dir, delete_checkpoint=delete)], epochs=3)
      seen[kind] = (history.epoch, os.path.isdir(backup_dir),
                    [w.tobytes() for w in model.get_weights()])
    assert seen["tfdp"] == seen["keras"]
    assert seen["tfdp"][1] == (not delete)


def test_early_stopping_ends_the_run_like_keras(tmp_path):
  seen = {}
  for kind in KINDS:
    backup_dir = str(tmp_path / kind)
    model = _model()
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    history = _fit(model, [_callback(kind, backup_dir), stop])
    seen[kind] = (history.epoch, os.path.isdir(backup_dir))
  assert seen["tfdp"] == seen["keras"]


@pytest.mark.parametrize("kwargs", [dict(backup_dir=""), dict(backup_dir="x", save_freq="batch"),
                                    dict(backup_dir="x", save_freq=None)])
def test_bad_arguments_raise_value_error_like_keras(kwargs):
  for kind in KINDS:
    with pytest.raises(ValueError):
      _callback(kind, **kwargs)


def test_unbuilt_model_raises_value_error_like_keras(tmp_path):
  for kind in KINDS:
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(ValueError, match="built"):
      model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                callbacks=[_callback(kind, str(tmp_path / kind))])
