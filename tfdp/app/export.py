"""Turns a trained model or a checkpoint into files that plain Keras and Hugging Face users load."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from absl import logging
import keras
import numpy as np

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.app import safetensors as safetensors_export
from tfdp.resume import train_state as state_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib

KERAS_FILE = layout_lib.KERAS_FILENAME


def _inference_view(model):
  """`model` without its compile state: the same layers and variables, no optimizer, loss or metrics.

  The compile state names tfdp's optimizer and schedule and the models'
  loss, which plain Keras cannot deserialize (`load_model` then fails), and
  it would carry the optimizer's slots. A functional or sequential model is
  re-wrapped around its own layers, so nothing is copied and no variable is
  created (under a strategy, creating one would be a collective).
  """
  if isinstance(model, keras.Sequential):
    if not model.inputs:
      raise errors.ConfigError(
          f"Model {model.name!r} is not built: call it on data (or start it with "
          "keras.Input) before saving it.")
    first = model.inputs[0]
    view = keras.Sequential(
        [keras.Input(batch_shape=first.shape, dtype=first.dtype, name=first.name)] + model.layers,
        name=model.name)
  elif type(model).__name__ == "Functional":  # keras.Model(inputs, outputs), not a subclass
    view = keras.Model(model.input, model.output, name=model.name)
  else:
    # A subclassed model: its own class must be importable at load anyway;
    # Keras saves it as it is.
    return model
  if not model.trainable:
    view.trainable = False
  return view


def _foreign_classes(config: Any) -> list[str]:
  """`module.Class` of every serialized object in `config` that plain Keras cannot rebuild."""
  found = []
  if isinstance(config, dict):
    module = config.get("module")
    if isinstance(module, str) and "class_name" in config and not (
        module == "keras" or module.startswith("keras.")):
      found.append(f"{module}.{config['class_name']}")
    for value in config.values():
      found.extend(_foreign_classes(value))
  elif isinstance(config, (list, tuple)):
    for value in config:
      found.extend(_foreign_classes(value))
  return sorted(set(found))


def save_keras(model: keras.Model, path: str, *, strategy: Any = None) -> str:
  """Saves `model` as a `.keras` file that plain `keras.models.load_model` opens.

  The file holds the architecture and the weights (`model.weights` and the
  other layer state Keras saves, such as batch-norm statistics), not the
  compile state: no optimizer, loss or metrics, so that a process that
  never imports tfdp loads it; `compile` the loaded model to train it
  further. A model of custom layers (e.g. `models.bert.TiedEmbedding`) still
  needs those classes at load time, passed as `custom_objects`; a warning
  names them. Subclassed models are saved as Keras saves them.

  Works for a model built under any `tf.distribute` strategy. Only the chief
  (as `tfdp.distribute.cluster.resolve` decides) writes; the other workers return at
  once (saving runs no collective, so they need not take part). The file is
  written under a temporary name in the same folder and renamed, so `path`
  holds either the previous file or the complete new one.

  Args:
    model: a built Keras model.
    path: where to write; must end in `.keras`. Missing folders are created.
    strategy: the job's strategy; None: the one in scope, or the one owning
      the model's variables.

  Returns:
    `path`.

  Raises:
    ConfigError: `path` does not end in `.keras`, or the model is not built.
  """
  path = os.fspath(path)
  if not path.endswith(".keras"):
    raise errors.ConfigError(
        f"{path}: a Keras model file must end in .keras (e.g. {os.path.join(path, KERAS_FILE)}).")
  if not cluster.resolve(strategy, objects=model).is_chief:
    return path
  view = _inference_view(model)
  foreign = _foreign_classes(keras.saving.serialize_keras_object(view))
  if foreign:
    logging.warning(
        "%s uses classes that are not part of Keras (%s): load it with "
        "keras.models.load_model(path, custom_objects={...}) naming them.",
        path, ", ".join(foreign))
  folder = os.path.dirname(path) or "."
  fs.makedirs(folder)
  # Keras insists on the .keras suffix; the leading dot keeps it out of globs.
  tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp.keras")
  try:
    view.save(tmp)
    fs.user_mode(tmp)
    fs.fsync_file(tmp)
    fs.rename(tmp, path)
  finally:
    if fs.exists(tmp):
      fs.remove(tmp)
  fs.fsync_dir(folder)
  return path


def model_run_config(model: str, model_kwargs: dict, *, seed: int,
                     dtype_policy: str | None = None) -> dict:
  """The run-config entries that `model_from_run_config` rebuilds a registry model from.

  `tfdp-train` adds them to the run config it saves, so that
  `tfdp-ckpt export --format=keras` can rebuild the model of any of its
  checkpoints.

  Args:
    model: the `--model` name (e.g. `cnn`, `bert`, `keras_app:MobileNetV2`).
    model_kwargs: what the builder is given besides the seed (the dataset's
      shapes and model flags such as `bert_config`); tuples and NumPy
      scalars are stored as JSON lists and numbers.
    seed: the builder's seed.
    dtype_policy: the Keras dtype policy the model is built under (default:
      the global one, e.g. `mixed_bfloat16` under --mixed_precision).

  Returns:
    {"model", "model_kwargs", "seed", "dtype_policy"}, JSON-ready.
  """
  def plain(value):
    if isinstance(value, (np.generic, np.ndarray)):
      return value.tolist()
    raise errors.ConfigError(f"model_kwargs hold {value!r}, which JSON cannot store.")

  return {"model": model, "model_kwargs": json.loads(json.dumps(model_kwargs, default=plain)),
          "seed": int(seed), "dtype_policy": dtype_policy or keras.config.dtype_policy().name}


def model_from_run_config(run_config: dict) -> keras.Model:
  """The (uncompiled) model of a `tfdp-train` run, built from the run config its checkpoints hold.

  It needs the entries of `model_run_config`: `model` (a `--model` name of
  the registry in `models/`), `model_kwargs` (what the builder was given
  besides the seed), `seed`, and optionally `dtype_policy` (default
  float32).

  Raises:
    ConfigError: the run config lacks these entries or names an unknown model.
  """
  import models  # pylint: disable=g-import-not-at-top
  name, kwargs = run_config.get("model"), run_config.get("model_kwargs")
  if not name or not isinstance(kwargs, dict):
    missing = "model" if not name else "model_kwargs"
    raise errors.ConfigError(
        f"it holds no model config and the run config has no {missing!r} entry, so the "
        "model cannot be rebuilt (checkpoints of this tfdp hold the model's Keras config "
        "unless Keras could not serialize it, and tfdp-train's also its name and builder "
        "arguments); export --format=safetensors instead, or build the model yourself "
        "and call tfdp.export.save_keras")
  try:
    spec = models.get(name)
  except KeyError as e:
    raise errors.ConfigError(str(e.args[0])) from None
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(run_config.get("dtype_policy") or "float32")
  try:
    return spec.build(seed=int(run_config.get("seed", 0)), **kwargs)
  finally:
    keras.config.set_dtype_policy(previous)


def _without_model_name(paths, name: str) -> dict[str, str] | None:
  """{path less a leading "`name`/": path} of `paths`; None when that would make two paths one."""
  prefix = f"{name}/"
  short = {p[len(prefix):] if p.startswith(prefix) else p: p for p in paths}
  return short if len(short) == len(paths) else None


def restore_model_variables(model: keras.Model, checkpoint: str) -> None:
  """Assigns `model.variables` from the `model/` keys of a `tfdp.TrainState` checkpoint.

  Variables are matched by path, up to a leading scope of the model's own
  name: a freshly built `Sequential`'s variables are
  `sequential/dense/kernel`, the same model rebuilt from its config has
  `dense/kernel`.

  Raises:
    ConfigError: the checkpoint's model variables do not match the model's
      (names or shapes).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(checkpoint)
  shapes = reader.get_variable_to_shape_map()
  saved = {named[0]: key for key in shapes
           if (named := safetensors_export.export_name(key))
           and key.startswith(safetensors_export.MODEL_PREFIX)}
  ours = {v.path: v for v in model.variables}
  short_saved = _without_model_name(saved, model.name)
  short_ours = _without_model_name(ours, model.name)
  if short_saved is not None and short_ours is not None:
    saved = {p: saved[full] for p, full in short_saved.items()}
    ours = {p: ours[full] for p, full in short_ours.items()}
  missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
  wrong = sorted(p for p in set(ours) & set(saved)
                 if tuple(shapes[saved[p]]) != tuple(ours[p].shape))
  if missing or extra or wrong:
    problem = (f"it lacks {missing[0]!r}" if missing else f"it has {extra[0]!r}, which the "
               "model lacks" if extra else f"{wrong[0]!r} has shape {shapes[saved[wrong[0]]]} "
               f"there, {tuple(ours[wrong[0]].shape)} in the model")
    if missing and extra:
      problem += (" (Keras numbers unnamed layers per process: rebuild the model in a "
                  "fresh process or after keras.backend.clear_session())")
    raise errors.ConfigError(
        f"{checkpoint}: does not fit the model its run config describes "
        f"({model.name}): {problem}")
  for p, v in ours.items():
    v.assign(reader.get_tensor(saved[p]))


def model_from_config(config: dict) -> keras.Model:
  """The (uncompiled) model a `tfdp.TrainState` checkpoint's Keras config describes (`tfdp.resume.train_state.model_config`).

  Raises:
    ConfigError: Keras cannot rebuild it (a class of the user's that is not
      registered, e.g. with `keras.saving.register_keras_serializable`).
  """
  try:
    return keras.saving.deserialize_keras_object(config)
  except Exception as e:  # pylint: disable=broad-except
    raise errors.ConfigError(
        f"Keras cannot rebuild the model from the config the checkpoint holds ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:300]}); register its classes with "
        "keras.saving.register_keras_serializable, or build the model yourself and call "
        "tfdp.export.save_keras") from None


def keras_from_checkpoint(checkpoint: str, path: str) -> str:
  """Writes the model of a `tfdp.TrainState` checkpoint as a `.keras` file (see `save_keras`).

  The model is rebuilt from the Keras config the checkpoint holds (every
  backup of `tfdp.callbacks.BackupAndRestore`), or for `tfdp-train`
  checkpoints from the model name and builder arguments of its run config.
  Variables are matched by path (up to a leading scope of the model's own
  name, see `restore_model_variables`), and Keras numbers unnamed layers per
  process (`conv2d`, `conv2d_1`, ...): call it in a process that has built
  no other model, or after `keras.backend.clear_session()`.

  Args:
    checkpoint: a checkpoint prefix, e.g. `model_dir/ckpt-100`.
    path: the `.keras` file to write.

  Returns:
    `path`.

  Raises:
    ConfigError: the checkpoint holds neither (see `model_from_run_config`),
      Keras cannot rebuild it, or it does not fit the model it describes.
  """
  run_config = state_lib.read_run_config(checkpoint)
  config = {} if run_config.get("model") else state_lib.read_model_config(checkpoint)
  try:
    model = model_from_config(config) if config else model_from_run_config(run_config)
  except errors.ConfigError as e:
    raise errors.ConfigError(f"{checkpoint}: {e}") from None
  restore_model_variables(model, checkpoint)
  return save_keras(model, path)
