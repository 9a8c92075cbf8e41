"""Tests of tfdp.callbacks.fit: the fit plan, and 2 mirrored replicas == 1 device on the same batches."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import cnn
from tfdp import data
from tfdp.distribute import strategy as S
from tfdp.callbacks import fit as training
from tfdp.callbacks.fit import Segment


@pytest.mark.parametrize("start, total, spe, expected", [
    (0, 20, 8, [Segment(0, 2, 0, 8), Segment(2, 3, 16, 4)]),
    (0, 16, 8, [Segment(0, 2, 0, 8)]),
    (5, 16, 8, [Segment(0, 1, 5, 3), Segment(1, 2, 8, 8)]),
    (5, 7, 8, [Segment(0, 1, 5, 2)]),
    (13, 40, 8, [Segment(1, 2, 13, 3), Segment(2, 5, 16, 8)]),
    (20, 20, 8, []),
])
def test_plan(start, total, spe, expected):
  assert training.plan(start, total, spe) == expected
  assert sum((s.last_epoch - s.first_epoch) * s.steps for s in expected) == total - start


def _train(strategy, steps=6, start=0, weights=None):
  source = data.synthetic_images(num_examples=256, image_shape=(8, 8, 3), seed=1)
  with strategy.scope():
    model = cnn.build(input_shape=(8, 8, 3), dropout=0.0, seed=1, sync_batch_norm=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  training.fit(model, lambda first: data.distribute(strategy, source, global_batch_size=16,
                                                    seed=3, start_step=first),
               start_step=0, train_steps=steps, steps_per_epoch=4, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == steps
  return [v.numpy() for v in model.weights]


def test_a_model_at_or_past_train_steps_says_so_and_trains_nothing(capsys):
  """A rerun of a finished script: one line, no fit call (verbose=0 keeps it silent)."""
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  model.optimizer.iterations.assign(12)
  made = []
  histories = training.fit(model, made.append, train_steps=12, steps_per_epoch=4)
  assert histories == [] and made == []
  assert capsys.readouterr().out == (
      "tfdp.fit: the model is at step 12, at or past train_steps=12; nothing to train.\n")
  assert training.fit(model, made.append, train_steps=8, steps_per_epoch=4, verbose=0) == []
  assert capsys.readouterr().out == ""


def test_two_mirrored_replicas_match_one_device():
  single = _train(tf.distribute.get_strategy())
  mirrored = _train(S.make_strategy("mirrored", cpu_replicas=2))
  initial = [v.numpy() for v in cnn.build(input_shape=(8, 8, 3), dropout=0.0, seed=1).weights]
  moved = 0
  for a, b, c in zip(single, mirrored, initial):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    moved += not np.allclose(a, c)
  assert moved >= 6  # training changed the weights; equality is not trivial
