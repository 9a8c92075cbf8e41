"""The run beyond the model in a backup (callbacks' and metrics' state) and the resume's epoch edges, in one process.

Each scenario is Keras's try/fit/fit-again pattern: a `fit` interrupted by
an exception, then `fit` again with fresh callbacks, in the same folders;
it must log, write and decide what the uninterrupted run does, bitwise
(op determinism). Models are rebuilt after `keras.backend.clear_session()`
so that their variables have the same paths in every run.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import tensorboard_events
from tfdp import callbacks
from tfdp.cli import ckpt

X = np.random.RandomState(0).normal(size=(80, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("int32")
BATCH = 8  # 10 steps an epoch


class _Interrupt(keras.callbacks.Callback):
  """Raises at the end of global step `step` (batch end), or as epoch `epoch` begins."""

  def __init__(self, step=None, epoch=None):
    super().__init__()
    self.step, self.epoch = step, epoch

  def on_train_batch_end(self, batch, logs=None):
    if self.step is not None and int(self.model.optimizer.iterations.numpy()) == self.step:
      raise RuntimeError("Interrupting!")

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      raise RuntimeError("Interrupting!")


class _Recorder(keras.callbacks.Callback):
  """Each epoch's logs."""

  def __init__(self):
    super().__init__()
    self.epochs = {}

  def on_epoch_end(self, epoch, logs=None):
    self.epochs[epoch] = dict(logs or {})


class Counter(keras.callbacks.Callback):
  """A user's callback with state of its own, saved through get_state/set_state."""

  def __init__(self):
    super().__init__()
    self.batches, self.losses = 0, []

  def on_train_batch_end(self, batch, logs=None):
    self.batches += 1
    self.losses.append(logs["loss"])

  def get_state(self):
    return {"batches": self.batches, "losses": np.array(self.losses)}

  def set_state(self, state):
    self.batches, self.losses = state["batches"], list(state["losses"])


def _model(metrics=("accuracy",)):
  # Layer names from zero again; without clear_session's gc.collect, which
  # names do not need and which takes seconds in a process holding TensorFlow.
  keras.backend.clear_session(free_memory=False)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dropout(0.2, seed=1), keras.layers.Dense(2)])
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=list(metrics))
  return model


def _run(folder, interrupt=None, data="arrays", save_freq=5, epochs=6):
  """One `fit` (interrupted or not) in `folder`; returns its callbacks by name and the model."""
  tf.config.experimental.enable_op_determinism()
  model = _model()
  cbs = {
      "backup": callbacks.BackupAndRestore(str(folder / "backup"), save_freq=save_freq,
                                           delete_checkpoint=False),
      "stop": keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=100),
      "plateau": keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5,
                                                   min_delta=100),
      "best": keras.callbacks.ModelCheckpoint(str(folder / "best.keras"), save_best_only=True),
      "csv": keras.callbacks.CSVLogger(str(folder / "log.csv")),
      "tb": keras.callbacks.TensorBoard(str(folder / "tb"), update_freq=1),
      "counter": Counter(), "record": _Recorder()}
  # The backup first: it acts after the others wherever it is.
  listed = list(cbs.values()) + ([interrupt] if interrupt else [])
  if data == "arrays":
    args = dict(x=X, y=Y, batch_size=BATCH, shuffle=False)
  else:  # A dataset whose number of batches Keras does not know.
    args = dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True)
                .batch(BATCH))
  try:
    model.fit(**args, epochs=epochs, validation_data=(X[:16], Y[:16]), callbacks=listed,
              verbose=0)
  except RuntimeError as e:
    assert "Interrupting" in str(e)
  return cbs, model


def _state(cbs, model):
  stop, plateau, best, counter = cbs["stop"], cbs["plateau"], cbs["best"], cbs["counter"]
  return {"stop": (stop.wait, stop.best, stop.stopped_epoch, stop.best_epoch),
          "plateau": (plateau.wait, plateau.best, plateau.cooldown_counter),
          "best": best.best, "counter": (counter.batches, counter.losses),
          "lr": float(model.optimizer.learning_rate.numpy())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run on arrays: (its folder, its callbacks, its model)."""
  folder = tmp_path_factory.mktemp("reference")
  cbs, model = _run(folder)
  return folder, cbs, model


def _compare(reference, tmp_path, data, interrupt, resumed_epoch):
  ref_folder, ref_cbs, ref_model = reference
  cut_cbs, _ = _run(tmp_path / "cut", interrupt=interrupt, data=data)
  # What the interrupted run's TensorBoard wrote past the backup reaches the
  # disk now, not when the garbage collector closes its writers mid-resume.
  cut_cbs["tb"]._close_writers()  # pylint: disable=protected-access
  cbs, model = _run(tmp_path / "cut", data=data)
  assert cbs["backup"].restored_step is not None
  assert min(cbs["record"].epochs) == resumed_epoch
  # The logs of every epoch the resumed fit ended, bitwise; the decisions and
  # state of every stateful callback, the files they wrote.
  for epoch, logs in cbs["record"].epochs.items():
    assert logs == ref_cbs["record"].epochs[epoch], epoch
  assert sorted(cbs["record"].epochs) == sorted(ref_cbs["record"].epochs)[resumed_epoch:]
  assert _state(cbs, model) == _state(ref_cbs, ref_model)
  assert (tmp_path / "cut" / "log.csv").read_bytes() == (ref_folder / "log.csv").read_bytes()
  assert (tensorboard_events.scalars(str(tmp_path / "cut" / "tb"))[0]
          == tensorboard_events.scalars(str(ref_folder / "tb"))[0])
  assert ref_cbs["stop"].stopped_epoch == 3  # EarlyStopping decided, 2 epochs before the end
  for a, b in zip(model.get_weights(), ref_model.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_resumed_mid_epoch_the_run_logs_writes_and_decides_as_the_uninterrupted_one(reference,
                                                                                  tmp_path,
                                                                                  caplog):
  # Killed at step 18; the backup of step 15 is in the middle of epoch 2.
  _compare(reference, tmp_path, "arrays", _Interrupt(step=18), resumed_epoch=1)
  # The restored metric state is taken once, at the resumed epoch's begin;
  # the later epochs begin from zero, with nothing to say.
  assert "metric state" not in caplog.text, caplog.text


def test_a_backup_after_an_epochs_last_step_resumes_with_that_epochs_end(tmp_path):
  # Keras knows no number of batches: the backup of step 10 is taken after
  # the epoch's last step, before its end (validation, the callbacks' epoch
  # end). The resumed fit runs no step of that epoch and ends it with the
  # epoch's restored metrics. (Its own reference: Keras's arrays and a
  # tf.data pipeline of the same batches differ in float rounding.)
  folder = tmp_path / "ref"
  _compare((folder, *_run(folder, data="unknown")), tmp_path, "unknown", _Interrupt(step=13),
           resumed_epoch=0)


def test_a_backup_on_an_epochs_last_step_is_taken_at_its_end_and_resumes_at_the_next(reference,
                                                                                   tmp_path):
  # Every 10 steps, the last of each epoch: the backup waits for the epoch's
  # end, so it holds that epoch's metrics and resumes at the next epoch.
  ref_folder, ref_cbs, _ = reference
  folder = tmp_path / "cut"
  _run(folder, interrupt=_Interrupt(epoch=2), save_freq=10)
  out = _inspect(str(folder / "backup" / "ckpt-20"))
  assert out["step"] == "20 (2 epochs done)"
  logs = ref_cbs["record"].epochs[1]
  assert out["metrics"] == "epoch 2: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(logs.items()))
  cbs, _ = _run(folder, save_freq=10)
  assert min(cbs["record"].epochs) == 2
  assert (folder / "log.csv").read_bytes() == (ref_folder / "log.csv").read_bytes()


def _inspect(prefix):
  import io  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  out = io.StringIO()
  assert ckpt.main(["inspect", prefix], out=out) == 0
  summary = out.getvalue().split("\n\n")[0]
  return dict(re.match(r"(\S+(?: \S+)?) +(.*)", line).groups() for line in summary.splitlines())


def test_metric_state_of_another_model_is_refused_with_a_warning(tmp_path, caplog):
  # A backup of a model with one metric, resumed into one with two.
  _run(tmp_path, interrupt=_Interrupt(step=18))
  model = _model(metrics=("accuracy", "sparse_categorical_accuracy"))
  backup = callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=5)
  model.fit(X, Y, batch_size=BATCH, epochs=2, callbacks=[backup], verbose=0, shuffle=False)
  assert "metric state does not fit" in caplog.text
