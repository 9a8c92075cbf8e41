"""Tests of tfdp.export and `tfdp-ckpt export`: files that plain Keras and safetensors load."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import models
from tfdp import cluster
from tfdp import errors
from tfdp import export
from tfdp import strategy as strategy_lib
from tfdp import trainer

# Loads a .keras file and predicts, in a process that imports neither tfdp
# nor models (it runs from another folder, without the repo on its path).
_PLAIN_KERAS = """
import sys
import keras
import numpy as np
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[3], model.predict(dict(np.load(sys.argv[2])), verbose=0))
assert not [m for m in sys.modules if m.split(".")[0] in ("tfdp", "models")]
"""


def _plain_keras_predict(path, inputs, tmp_path):
  """Predictions of the .keras file at `path` on `inputs` (a dict), made by plain Keras."""
  np.savez(tmp_path / "inputs.npz", **inputs)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  p = subprocess.run(
      [sys.executable, "-c", _PLAIN_KERAS, str(path), str(tmp_path / "inputs.npz"),
       str(tmp_path / "out.npy")], cwd=str(tmp_path), env=env, capture_output=True,
      text=True, timeout=120, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return np.load(tmp_path / "out.npy")


def _compiled(name, **kwargs):
  """A registry model compiled as tfdp-train compiles it (tfdp's optimizer and the models' loss)."""
  spec = models.get(name)
  model = spec.build(seed=1, **kwargs)
  trainer._compile(model, trainer.TrainConfig(model=name), spec)  # pylint: disable=protected-access
  model.optimizer.build(model.trainable_variables)
  return model


def test_save_keras_loads_in_plain_keras_with_the_same_predictions(tmp_path):
  # Built and compiled under 2 mirrored replicas, as tfdp-train builds it;
  # dlrm has dict inputs and keras.ops in its graph.
  with strategy_lib.make_strategy("mirrored", cpu_replicas=2).scope():
    model = _compiled("dlrm", vocab_sizes={"user": 7, "item": 5}, num_dense=3)
  rng = np.random.default_rng(0)
  inputs = {"dense": rng.normal(size=(6, 3)).astype("float32"),
            "user": rng.integers(0, 7, 6).astype("int32"),
            "item": rng.integers(0, 5, 6).astype("int32")}
  path = tmp_path / "out" / "model.keras"
  assert export.save_keras(model, path) == str(path)
  assert os.listdir(tmp_path / "out") == ["model.keras"]  # no temp file left
  np.testing.assert_allclose(_plain_keras_predict(path, inputs, tmp_path),
                             model.predict(inputs, verbose=0), rtol=1e-5, atol=1e-6)
  # The caller's model keeps its compile state.
  assert model.compiled and model.optimizer.iterations is not None


def test_save_keras_chief_only_and_bad_path(tmp_path, monkeypatch):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  with pytest.raises(errors.ConfigError, match="end in .keras"):
    export.save_keras(model, tmp_path / "model.h5")
  monkeypatch.setattr(cluster, "resolve", lambda *a, **k: cluster.Worker(1, 2))
  assert export.save_keras(model, tmp_path / "m.keras") == str(tmp_path / "m.keras")
  assert not os.listdir(tmp_path)


def test_save_keras_names_classes_plain_keras_lacks(tmp_path, caplog):
  model = _compiled("bert", vocab_size=40, seq_len=8, max_predictions=2)
  path = export.save_keras(model, tmp_path / "bert.keras")
  assert "models.bert.TiedEmbedding" in caplog.text
  loaded = keras.models.load_model(
      path, custom_objects={"TiedEmbedding": models.bert.TiedEmbedding})
  assert [v.path for v in loaded.weights] == [v.path for v in model.weights]
