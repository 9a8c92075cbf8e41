"""Turns a trained model or a checkpoint into files that plain Keras and Hugging Face users load."""

from __future__ import annotations

import os
import uuid
from typing import Any

from absl import logging
import keras

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import fs

KERAS_FILE = "model.keras"


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
  elif type(model) is keras.Model or type(model).__name__ == "Functional":
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
  (as `tfdp.cluster.resolve` decides) writes; the other workers return at
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
    fs.fsync_file(tmp)
    fs.rename(tmp, path)
  finally:
    if fs.exists(tmp):
      fs.remove(tmp)
  fs.fsync_dir(folder)
  return path
