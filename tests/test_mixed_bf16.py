"""mixed_bfloat16 predict and evaluate under every strategy: none, the user's MirroredStrategy over 2 CPUs, 2 workers.

The cells of the Keras matrix (tests/test_keras_matrix.py) for
`keras.config.set_dtype_policy("mixed_bfloat16")` with `predict` and
`evaluate`: the model's outputs are bfloat16, which collectives cannot
gather across workers without tfdp.compat's concat_gather_dtypes. The
2-worker cell runs at the end of tests/test_keras_run.py's uninterrupted
launch (tests/workers/keras_run.py, TFDP_TEST_BF16=1).
"""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_keras_run import keras_runs  # pylint: disable=unused-import

ROWS, BATCH = 32, 16
# bfloat16 keeps 8 bits of mantissa; a CPU kernel rounds 16 rows and 32 rows
# differently, a relative change of up to 2^-8 in an activation.
TOLERANCE = 0.05


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8, 8, 3)).astype("float32")
  return x, (x[..., 0].mean(axis=(1, 2)) > 0).astype("int32")


def _cell(strategy):
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    keras.utils.set_random_seed(1)
    with strategy.scope():
      model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                                keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
      model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    x, y = _data()
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    direct = np.asarray(model(x, training=False), "float32")
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
  finally:
    keras.config.set_dtype_policy("float32")
  return predicted, direct, evaluated


@pytest.mark.parametrize("kind", ["none", "own_mirrored"])
def test_bfloat16_predict_and_evaluate_in_one_process(kind):
  if kind == "none":
    strategy = tf.distribute.get_strategy()
  else:  # As a user builds one (ReductionToOneDevice: see test_compat._mirrored_fit).
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(
        cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())
  predicted, direct, evaluated = _cell(strategy)
  assert predicted.dtype.name == "bfloat16" and predicted.shape == (ROWS, 4)
  np.testing.assert_allclose(np.asarray(predicted, "float32"), direct, atol=TOLERANCE)
  assert len(evaluated) == 2 and np.isfinite(evaluated).all()


@pytest.mark.slow
def test_bfloat16_predict_and_evaluate_on_2_workers(keras_runs):
  code, out = keras_runs["reference"]
  assert code == 0, out[-3000:]
  cells = {int(w): json.loads(body) for w, body in re.findall(
      r"^\[worker (\d)\] BF16 worker=\d (\{.*\})$", out, re.M)}
  assert sorted(cells) == [0, 1], out[-3000:]
  for cell in cells.values():
    assert "predict_error" not in cell, cell
    assert cell["predict_dtype"] == "bfloat16" and cell["predict_shape"] == [ROWS, 4], cell
    assert cell["predict_max_error"] < TOLERANCE, cell
  assert cells[0]["evaluate"] == cells[1]["evaluate"] and np.isfinite(cells[0]["evaluate"]).all()
