"""Tests of tfdp.export and `tfdp-ckpt export`: files that plain Keras and safetensors load."""

import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import models
from tfdp import cluster
from tfdp import errors
from tfdp import export
from tfdp.app import optim
from tfdp.distribute import strategy as strategy_lib
from tfdp.app import trainer

# Loads .keras files and predicts, in a process that imports neither tfdp nor
# models (it runs from another folder, without the repo on its path). One
# process for every file: starting TensorFlow is most of its time.
_PLAIN_KERAS = """
import sys
import keras
import numpy as np
for i, path in enumerate(sys.argv[2:]):
  model = keras.models.load_model(path)
  inputs = np.load(f"{sys.argv[1]}/inputs{i}.npz")
  np.save(f"{sys.argv[1]}/out{i}.npy", model.predict(dict(inputs), verbose=0))
assert not [m for m in sys.modules if m.split(".")[0] in ("tfdp", "models")]
"""


def _plain_keras_predict(jobs, tmp_path):
  """Predictions of each (.keras file, inputs dict) of `jobs`, made by plain Keras."""
  for i, (_, inputs) in enumerate(jobs):
    np.savez(tmp_path / f"inputs{i}.npz", **inputs)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  p = subprocess.run(
      [sys.executable, "-c", _PLAIN_KERAS, str(tmp_path)] + [str(path) for path, _ in jobs],
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return [np.load(tmp_path / f"out{i}.npy") for i in range(len(jobs))]


def _compiled(name, **kwargs):
  """A registry model compiled as tfdp-train compiles it (tfdp's optimizer and the models' loss)."""
  spec = models.get(name)
  model = spec.build(seed=1, **kwargs)
  model.compile(optimizer=optim.from_config(trainer.TrainConfig(model=name), spec),
                **spec.compile_args())
  model.optimizer.build(model.trainable_variables)
  return model


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


# -- A checkpoint of a trained model, as tfdp-train leaves one ----------------------

_KWARGS = {"input_shape": [8, 8, 3], "num_classes": 3, "width": 4}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A cnn trained 2 steps and checkpointed through TrainState, with tfdp-train's run config."""
  import tfdp  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("export")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
  # The layer names a fresh process gives (Keras numbers unnamed layers per
  # process). Here and below without clear_session's gc.collect, which names
  # do not need and which takes seconds in a process holding TensorFlow.
  keras.backend.clear_session(free_memory=False)
  model = _compiled("cnn", **_KWARGS)
  model.fit(x, np.arange(16) % 3, batch_size=8, epochs=1, verbose=0)
  run_config = dict(export.model_run_config("cnn", dict(_KWARGS, input_shape=(8, 8, 3)), seed=1),
                    dataset="synthetic", global_batch_size=8)
  assert run_config["model_kwargs"] == _KWARGS and run_config["dtype_policy"] == "float32"
  paths = {}
  for name, config in (("full", run_config), ("no_model", {"seed": 1})):
    state = tfdp.TrainState(model, run_config=config)
    with tfdp.CheckpointManager(state.checkpoint, str(root / name)) as manager:
      paths[name] = manager.save()
  return {"root": root, "ckpt": paths["full"], "no_model": paths["no_model"],
          "x": x, "predictions": model.predict(x, verbose=0),
          "weights": {v.path for v in model.weights},
          "optimizer": {v.path.split("/", 1)[1] for v in model.optimizer.variables}}


def _cli(*argv):
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  out, err = io.StringIO(), io.StringIO()
  code = ckpt.main([str(a) for a in argv], out=out, err=err)
  return code, out.getvalue(), err.getvalue()


def _load_folder(folder):
  """{name: array} of a safetensors export, and the __metadata__ of its files."""
  tensors, metadata = {}, []
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      tensors.update(safetensors.numpy.load_file(os.path.join(folder, name)))
      with safetensors.safe_open(os.path.join(folder, name), "np") as f:
        metadata.append(f.metadata())
  return tensors, metadata


def test_safetensors_weights_only_set_into_a_fresh_model_predict_the_same(trained, tmp_path):
  code, out, err = _cli("export", trained["ckpt"], tmp_path)
  assert code == 0, err
  assert "left out" in out and "--include_optimizer" in out
  assert os.listdir(tmp_path) == ["model.safetensors"]  # one shard: no index, as HF
  tensors, (metadata,) = _load_folder(tmp_path)
  assert set(tensors) == trained["weights"]  # no slots, no iteration, no RNG state
  assert metadata == {"format": "keras", "source": os.path.abspath(trained["ckpt"]),
                      "step": "2", "contents": "weights"}
  keras.backend.clear_session(free_memory=False)
  fresh = models.get("cnn").build(seed=7, **_KWARGS)
  for v in fresh.weights:
    v.assign(tensors[v.path])
  np.testing.assert_array_equal(fresh.predict(trained["x"], verbose=0), trained["predictions"])


def test_safetensors_include_optimizer_sharded_like_hugging_face(trained, tmp_path):
  code, _, err = _cli("export", trained["ckpt"], tmp_path, "--include_optimizer",
                      "--max_shard_size=500B")
  assert code == 0, err
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  n = len(files)
  assert n > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
  assert sorted(os.listdir(tmp_path)) == files + ["model.safetensors.index.json"]
  tensors, metadata = _load_folder(tmp_path)
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
  assert set(index["weight_map"]) == set(tensors) == (
      trained["weights"] | {"optimizer/" + p for p in trained["optimizer"]}
      | {"seed_generator/seed_generator_state"})
  assert tensors["optimizer/iteration"] == 2
  assert {m["contents"] for m in metadata} == {"weights+optimizer"}
  for name, file_name in index["weight_map"].items():
    assert name in safetensors.numpy.load_file(tmp_path / file_name)


def test_safetensors_refuses_a_folder_with_other_shards_unless_overwrite(trained, tmp_path):
  stale = ["model-00001-of-00005.safetensors", "model.safetensors.index.json"]
  for name in stale + ["notes.txt"]:
    (tmp_path / name).write_text("old")
  code, out, err = _cli("export", trained["ckpt"], tmp_path)
  assert (code, out, err.count("\n")) == (2, "", 1) and "--overwrite" in err, err
  assert (tmp_path / stale[0]).read_text() == "old"
  assert _cli("export", trained["ckpt"], tmp_path, "--overwrite")[0] == 0
  # A loader globbing *.safetensors sees each tensor once; other files stay.
  assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "notes.txt"]


@pytest.mark.slow
def test_keras_files_load_in_plain_keras_with_the_same_predictions(trained, backups, tmp_path):
  # save_keras of a model built and compiled under 2 mirrored replicas, as
  # tfdp-train builds it (dlrm: dict inputs, keras.ops in its graph) ...
  with strategy_lib.make_strategy("mirrored", cpu_replicas=2).scope():
    model = _compiled("dlrm", vocab_sizes={"user": 7, "item": 5}, num_dense=3)
  rng = np.random.default_rng(0)
  inputs = {"dense": rng.normal(size=(6, 3)).astype("float32"),
            "user": rng.integers(0, 7, 6).astype("int32"),
            "item": rng.integers(0, 5, 6).astype("int32")}
  saved = tmp_path / "saved" / "model.keras"
  assert export.save_keras(model, saved) == str(saved)
  assert os.listdir(saved.parent) == ["model.keras"]  # no temp file left
  assert model.compiled and model.optimizer.built  # the caller's model keeps its compile state
  # ... and tfdp-ckpt export --format=keras of a checkpoint.
  code, out, err = _cli("export", trained["ckpt"], tmp_path / "out", "--format=keras")
  exported = tmp_path / "out" / "model.keras"
  assert (code, out) == (0, f"wrote {exported}\n"), err
  # A user's compiled Sequential model.
  sequential = keras.Sequential([keras.Input((3,), name="x"), keras.layers.Dense(4),
                                 keras.layers.Dropout(0.5, seed=2), keras.layers.Dense(2)])
  sequential.compile(optimizer="adam", loss="mse")
  export.save_keras(sequential, tmp_path / "sequential.keras")
  # The exports of BackupAndRestore's backups (a Sequential, a functional model).
  kinds = ("sequential", "functional")
  ours, theirs, users, *backed_up = _plain_keras_predict(
      [(saved, inputs), (exported, {"image": trained["x"]}),
       (tmp_path / "sequential.keras", {"x": inputs["dense"]})]
      + [(backups[kind]["file"], {"x": backups["x"]}) for kind in kinds], tmp_path)
  for kind, got in zip(kinds, backed_up):
    np.testing.assert_allclose(got, backups[kind]["predictions"], rtol=1e-6, atol=1e-6,
                               err_msg=kind)
  np.testing.assert_allclose(ours, model.predict(inputs, verbose=0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(theirs, trained["predictions"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(users, sequential.predict(inputs["dense"], verbose=0))


def test_format_keras_arguments(trained, tmp_path):
  path = tmp_path / "m.keras"  # OUT may name the file
  assert _cli("export", trained["ckpt"], path, "--format=keras")[0] == 0
  code, out, err = _cli("export", trained["ckpt"], path, "--format=keras")
  assert (code, out, err.count("\n")) == (2, "", 1) and "--overwrite" in err, err
  assert _cli("export", trained["ckpt"], path, "--format=keras", "--overwrite")[0] == 0
  for flag in ("--include_optimizer", "--max_shard_size=1GB"):
    code, _, err = _cli("export", trained["ckpt"], tmp_path / "x", "--format=keras", flag)
    assert code == 2 and "--format=safetensors" in err and err.count("\n") == 1


def test_format_keras_of_any_keras_model_from_the_config_its_checkpoint_holds(trained, tmp_path):
  # A user's checkpoint (tfdp.TrainState, BackupAndRestore): its run config
  # names no tfdp-train model, but it holds the model's Keras config.
  code, out, err = _cli("export", trained["no_model"], tmp_path / "out", "--format=keras")
  assert (code, err) == (0, ""), err
  loaded = keras.models.load_model(tmp_path / "out" / "model.keras")
  np.testing.assert_allclose(loaded.predict(trained["x"], verbose=0), trained["predictions"],
                             rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def backups(tmp_path_factory):
  """A Sequential and a functional model trained with tfdp's BackupAndRestore, their last backups exported by `tfdp-ckpt export --format=keras`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("backups")
  rng = np.random.default_rng(2)
  x = rng.normal(size=(16, 3)).astype("float32")
  inputs = keras.Input((3,), name="x")
  built = {
      # A freshly built Sequential's variables are `sequential/dense/kernel`,
      # the same model rebuilt from its config has `dense/kernel`.
      "sequential": keras.Sequential([keras.Input((3,), name="x"), keras.layers.Dense(4),
                                      keras.layers.Dense(2)]),
      "functional": keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs))),
  }
  result = {"x": x}
  for name, model in built.items():
    model.compile(optimizer="adam", loss="mse")
    backup = tfdp.callbacks.BackupAndRestore(str(root / name), save_freq=2,
                                             delete_checkpoint=False)
    model.fit(x, x[:, :2] * 2, batch_size=8, epochs=1, verbose=0, callbacks=[backup])
    out = root / f"{name}.keras"
    result[name] = {"paths": [v.path for v in model.weights], "file": str(out),
                    "predictions": model.predict(x, verbose=0),
                    "export": _cli("export", tf.train.latest_checkpoint(str(root / name)), out,
                                   "--format=keras")}
  return result


@pytest.mark.parametrize("name", ["sequential", "functional"])
def test_format_keras_of_a_backup_loads_in_keras_with_the_same_predictions(backups, name):
  run = backups[name]
  assert run["export"] == (0, f"wrote {run['file']}\n", ""), run["export"]
  loaded = keras.models.load_model(run["file"])
  np.testing.assert_allclose(loaded.predict(backups["x"], verbose=0), run["predictions"],
                             rtol=1e-6, atol=1e-6)


class _Unregistered(keras.Model):
  """A subclassed model whose class Keras cannot find by name (not registered)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(2)

  def call(self, x):
    return self.dense(x)


def test_format_keras_of_a_model_keras_cannot_rebuild_is_one_line_exit_2(tmp_path):
  import tfdp  # pylint: disable=g-import-not-at-top
  model = _Unregistered()
  model(np.zeros((1, 3), "float32"))
  model.compile("sgd", "mse")
  state = tfdp.TrainState(model, run_config={"seed": 1})
  with tfdp.CheckpointManager(state.checkpoint, str(tmp_path / "ckpt")) as manager:
    prefix = manager.save()
  code, out, err = _cli("export", prefix, tmp_path / "out", "--format=keras")
  assert (code, out, err.count("\n")) == (2, "", 1), err
  assert prefix in err and "register_keras_serializable" in err and "save_keras" in err
  assert not (tmp_path / "out").exists()


def test_exports_get_the_users_umask(trained, tmp_path):
  old = os.umask(0o027)
  try:
    assert _cli("export", trained["ckpt"], tmp_path / "one")[0] == 0
    assert _cli("export", trained["ckpt"], tmp_path / "many", "--max_shard_size=500B")[0] == 0
    assert _cli("export", trained["ckpt"], tmp_path / "k.keras", "--format=keras")[0] == 0
  finally:
    os.umask(old)
  files = [tmp_path / "one" / "model.safetensors", tmp_path / "k.keras"] + sorted(
      (tmp_path / "many").iterdir())
  assert len(files) > 3
  assert {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o640)}, files


def test_model_run_config_rebuilds_under_its_dtype_policy_and_checks_the_fit(trained):
  entries = export.model_run_config("cnn", _KWARGS, seed=3, dtype_policy="mixed_bfloat16")
  model = export.model_from_run_config(json.loads(json.dumps(entries)))
  assert model.get_layer("logits").dtype_policy.name == "mixed_bfloat16"
  assert keras.config.dtype_policy().name == "float32"  # the global policy is left alone
  with pytest.raises(errors.ConfigError, match="Unknown model 'nope'"):
    export.model_from_run_config(dict(entries, model="nope"))
  keras.backend.clear_session(free_memory=False)
  other = models.get("cnn").build(seed=1, **dict(_KWARGS, num_classes=4))
  with pytest.raises(errors.ConfigError, match=r"'logits/bias' has shape \[3\] there, \(4,\)"):
    export.restore_model_variables(other, trained["ckpt"])
