"""A backup of another model is refused before any variable is assigned, unless allow_partial_restore."""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import errors

X = np.random.RandomState(0).normal(size=(40, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _model(width=8, added=False):
  keras.utils.set_random_seed(1)
  layers = [keras.Input((4,)), keras.layers.Dense(width, name="hidden"),
            keras.layers.Dense(1, name="out")]
  if added:
    layers.append(keras.layers.Dense(4, name="added"))
  model = keras.Sequential(layers, name="mlp")
  model.compile(keras.optimizers.SGD(0.01), "mse")
  return model


@pytest.fixture(scope="module")
def backup(tmp_path_factory):
  """A backup at step 5 of the 8-wide model, kept."""
  d = str(tmp_path_factory.mktemp("incompatible") / "backup")
  _model().fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[
      tfdp.callbacks.BackupAndRestore(d, delete_checkpoint=False)])
  return d


def _values(model):
  return [v.numpy().copy() for v in model.variables]


def _fit(model, d, **kwargs):
  return model.fit(X, Y if model.output_shape[-1] == 1 else np.tile(Y, 4), batch_size=8,
                   epochs=2, verbose=0,
                   callbacks=[tfdp.callbacks.BackupAndRestore(d, delete_checkpoint=False,
                                                              **kwargs)])


CHANGES = {  # change -> (model, a difference the error names)
    "a layer added": (lambda: _model(added=True), "mlp/added/kernel"),
    "a width changed": (lambda: _model(width=9),
                        "mlp/hidden/kernel is float32 [4, 8] in it, "
                        "float32 [4, 9] here"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_backup_of_another_model_is_refused_before_any_variable_changes(backup, change):
  make, difference = CHANGES[change]
  model = make()
  before = _values(model)
  with pytest.raises(errors.IncompatibleCheckpointError) as raised:
    _fit(model, backup)
  message = str(raised.value)
  assert backup in message and difference in message, message
  assert "allow_partial_restore=True" in message and "\n" not in message
  for was, now in zip(before, _values(model)):
    np.testing.assert_array_equal(was, now)
  assert os.path.exists(os.path.join(backup, "ckpt-5.manifest.json"))  # Not set aside.


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_allow_partial_restore_restores_what_matches_and_lists_the_rest(backup, change, caplog,
                                                                        tmp_path):
  make, difference = CHANGES[change]
  model = make()
  cb = tfdp.callbacks.BackupAndRestore(backup, delete_checkpoint=False,
                                       allow_partial_restore=True)
  with caplog.at_level(logging.WARNING):
    cb.restore(model)
  assert cb.restored_step == 5
  assert "not restored: " in caplog.text and difference in caplog.text, caplog.text
  reader = tf.train.load_checkpoint(os.path.join(backup, "ckpt-5"))
  out = "model/mlp/out/bias/.ATTRIBUTES/VARIABLE_VALUE"  # The same shape in every change.
  np.testing.assert_array_equal(model.get_layer("out").bias.numpy(), reader.get_tensor(out))
  assert int(model.optimizer.iterations.numpy()) == 5
  cb.manager.close()


def test_a_model_built_again_in_the_same_process_resumes_under_its_new_names(tmp_path):
  """Keras numbers automatic names on: `sequential_1/dense_2` is `sequential/dense` built again."""
  d = str(tmp_path / "backup")

  def unnamed():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model

  first = unnamed()
  first.fit(X, Y, batch_size=8, epochs=1, verbose=0,
            callbacks=[tfdp.callbacks.BackupAndRestore(d, delete_checkpoint=False)])
  again = unnamed()
  assert again.layers[0].kernel.path != first.layers[0].kernel.path
  cb = tfdp.callbacks.BackupAndRestore(d, delete_checkpoint=False)
  cb.restore(again)
  assert cb.restored_step == 5
  pairs = list(zip(first.variables, again.variables)) + list(
      zip(first.optimizer.variables, again.optimizer.variables))  # Its slots, named by the layers.
  assert len(pairs) == len(first.variables) + len(first.optimizer.variables)
  for a, b in pairs:
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=b.path)
  cb.manager.close()
