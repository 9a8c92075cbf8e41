"""Every kind of broken backup falls back to the newest intact one in BackupAndRestore, under model.fit and tfdp.fit."""

import logging
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.test_fallback import BROKEN, MANIFEST

X = np.random.RandomState(0).normal(size=(40, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(keras.optimizers.SGD(0.01), "mse")
  return model


@pytest.fixture(scope="module")
def backups(tmp_path_factory):
  """Backups at steps 5 and 10 (2 epochs of 5 steps), shared by every case."""
  d = str(tmp_path_factory.mktemp("backups") / "base")
  _model().fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
      tfdp.callbacks.BackupAndRestore(d, double_checkpoint=True, delete_checkpoint=False)])
  assert sorted(f for f in os.listdir(d) if f.endswith(MANIFEST)) == [
      "ckpt-10" + MANIFEST, "ckpt-5" + MANIFEST]
  return d


@pytest.mark.parametrize("entry", ["model.fit", "tfdp.fit"])
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_newest_backup_is_set_aside_and_training_goes_on(backups, tmp_path, kind,
                                                                  entry, caplog):
  d = str(tmp_path / "backup")
  shutil.copytree(backups, d)
  newest = os.path.join(d, "ckpt-10")
  damage, bad_file = BROKEN[kind]
  damage(newest)
  model = _model()
  cb = tfdp.callbacks.BackupAndRestore(d, double_checkpoint=True, delete_checkpoint=False)
  with caplog.at_level(logging.WARNING):
    if entry == "model.fit":
      history = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
      assert history.epoch == [1, 2]
    else:
      tfdp.fit(model, lambda step: tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()
               .skip(step % 5), epochs=3, steps_per_epoch=5, callbacks=[cb], verbose=0)
  assert cb.restored_step == 5
  assert newest + bad_file in caplog.text
  assert os.path.exists(newest + MANIFEST + ".corrupt")
  assert int(model.optimizer.iterations.numpy()) == 15
  assert tf.train.latest_checkpoint(d) == os.path.join(d, "ckpt-15")
