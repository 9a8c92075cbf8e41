"""Turns a trained model or a checkpoint into files that plain Keras and Hugging Face users load."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import uuid
from typing import Any

from absl import logging
import keras
import numpy as np

from tfdp import cluster
from tfdp import errors
from tfdp import state as state_lib
from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib

KERAS_FILE = layout_lib.KERAS_FILENAME
# Hugging Face's names: one file when the export fits one shard, else
# model-0000K-of-0000N.safetensors plus the index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"
_EXPORT_GLOBS = ("*.safetensors", "*.safetensors.index.json")
# Hugging Face's default shard size (huggingface_hub counts 5GB as 5 * 10**9).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
# `__metadata__["format"]`: the tensors are Keras variables in Keras's layout
# (Dense kernels are [in, out]), named by their Keras paths.
FORMAT = "keras"
OPTIMIZER_PREFIX = "optimizer/"

_MODEL_PREFIX = "model/"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
# Keras names the state variable of every SeedGenerator (dropout, augmentation) so.
_RNG_STATE = "seed_generator_state"
_DTYPES = frozenset(("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32",
                     "uint64", "int64", "float16", "bfloat16", "float32", "float64"))


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
    user_mode(tmp)
    fs.fsync_file(tmp)
    fs.rename(tmp, path)
  finally:
    if fs.exists(tmp):
      fs.remove(tmp)
  fs.fsync_dir(folder)
  return path


def _umask() -> int:
  """This process's umask (Linux: from /proc, as setting it to read it races other threads)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      return int(next(l for l in f if l.startswith("Umask:")).split()[1], 8)
  except (OSError, StopIteration, ValueError):
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def user_mode(path: str) -> None:
  """Gives a local file the mode `open()` gives: 0666 less the umask (`safetensors` and `mkstemp` give 0600)."""
  if "://" not in path:
    os.chmod(path, 0o666 & ~_umask())


# -- safetensors ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SafetensorsExport:
  """What `save_safetensors` wrote.

  Attributes:
    folder: the output folder.
    files: the names written in it: the shards, then the index if any.
    names: the exported tensor names, in file order (the model's by path,
      then the optimizer's).
    total_size: bytes of tensor data (the index's `metadata.total_size`).
    step: the checkpoint's global step, when it records one.
    left_out: names of the optimizer and RNG tensors not exported
      (`include_optimizer=False`).
  """

  folder: str
  files: tuple[str, ...]
  names: tuple[str, ...]
  total_size: int
  step: int | None
  left_out: tuple[str, ...]


def export_name(key: str) -> tuple[str, bool] | None:
  """The export name of a checkpoint key and whether it is a weight; None for bookkeeping.

  `model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE` (a `tfdp.TrainState` key)
  -> (`dense/kernel`, True): the Keras `variable.path`. Optimizer variables
  keep the `optimizer/` prefix (`optimizer/iteration`,
  `optimizer/dense_kernel_momentum`) and, like the state of SeedGenerators
  (`seed_generator/seed_generator_state`), are not weights. Keys that are no
  variable (the object graph, the run config, `save_counter`, per-worker
  state outside `model/` and `optimizer/`) give None.
  """
  if not key.endswith(_VALUE_SUFFIX):
    return None
  path = key[:-len(_VALUE_SUFFIX)]
  if path.startswith(_MODEL_PREFIX):
    path = path[len(_MODEL_PREFIX):]
    return path, path.rsplit("/", 1)[-1] != _RNG_STATE
  if path.startswith(OPTIMIZER_PREFIX):
    return path, False
  return None


def checkpoint_step(checkpoint: str) -> int | None:
  """The global step of a checkpoint: its optimizer's iteration count (a `tfdp.TrainState`'s), else its manifest's step."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(checkpoint)
  if reader.has_tensor(state_lib.ITERATIONS_KEY):
    return int(reader.get_tensor(state_lib.ITERATIONS_KEY))
  manifest = manifest_lib.read_manifest(checkpoint)
  return None if manifest is None else int(manifest.step)


def existing_exports(folder: str) -> list[str]:
  """Names of the safetensors files and indexes already in `folder`."""
  if not os.path.isdir(folder):
    return []
  return sorted(n for n in os.listdir(folder)
                if any(fnmatch.fnmatch(n, g) for g in _EXPORT_GLOBS))


def _shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
  """Greedy in name order, as Hugging Face shards: a tensor larger than the cap gets its own shard."""
  shards, current, used = [], [], 0
  for name, nbytes in sizes:
    if current and used + nbytes > max_shard_size:
      shards.append(current)
      current, used = [], 0
    current.append(name)
    used += nbytes
  if current:
    shards.append(current)
  return shards


def save_safetensors(checkpoint: str, folder: str, *, include_optimizer: bool = False,
                     max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                     overwrite: bool = False) -> SafetensorsExport:
  """Exports a checkpoint's tensors as Hugging Face safetensors, through the `safetensors` package.

  Layout: `model.safetensors` when everything fits one shard, else
  `model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json`
  (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`), as
  Hugging Face writes them.

  Names: each tensor is named by its Keras variable path (`variable.path`),
  e.g. `conv2d/kernel`, `batch_normalization/moving_mean`, so
  `{v.path: v for v in model.weights}` of a freshly built model finds
  every weight. With `include_optimizer`, the optimizer's variables follow
  as `optimizer/<name>` (`optimizer/iteration` is the global step,
  `optimizer/conv2d_kernel_momentum` a slot) and SeedGenerator states as
  their paths (`seed_generator/seed_generator_state`).

  Every file's `__metadata__` holds `format` ("keras": Keras variables in
  Keras's layout), `source` (the checkpoint's absolute path), `step` (its
  global step, when known) and `contents` ("weights" or
  "weights+optimizer"), all strings as safetensors requires.

  Args:
    checkpoint: a checkpoint prefix, e.g. `model_dir/ckpt-100`.
    folder: a local output folder; created if missing.
    include_optimizer: also export the optimizer's variables (slots and
      iteration count) and the RNG state; by default only the model's
      weights (`model.weights`: trainable and non-trainable).
    max_shard_size: the most bytes of tensor data per file (a larger tensor
      gets a file of its own).
    overwrite: remove the safetensors files and indexes already in `folder`
      first; without it such a folder is refused.

  Returns:
    A SafetensorsExport.

  Raises:
    ConfigError: `folder` already holds an export and not `overwrite`, a
      bad `max_shard_size`, or a checkpoint with no model variables.
    tf.errors.OpError: the checkpoint cannot be read.
  """
  # pylint: disable=g-import-not-at-top
  import safetensors.numpy
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  if max_shard_size < 1:
    raise errors.ConfigError(f"max_shard_size must be at least 1 byte, got {max_shard_size}.")
  reader = tf.train.load_checkpoint(checkpoint)
  shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
  keys, sizes, left_out = {}, [], []
  for key in sorted(shapes):
    named = export_name(key)
    if named is None or dtypes[key].name not in _DTYPES:
      continue
    name, is_weight = named
    if not (is_weight or include_optimizer):
      left_out.append(name)
      continue
    if name in keys:
      raise errors.ConfigError(
          f"{checkpoint}: two variables would both be exported as {name!r} (a layer "
          f"named {OPTIMIZER_PREFIX.rstrip('/')!r}?); rename one.")
    keys[name] = key
    sizes.append((name, int(np.prod(shapes[key], dtype=np.int64)) * dtypes[key].size))
  if not any(named[1] for named in map(export_name, shapes) if named):
    raise errors.ConfigError(
        f"{checkpoint}: holds no model variables (keys under {_MODEL_PREFIX}); "
        "export checkpoints written through tfdp.TrainState or tfdp-train.")
  stale = existing_exports(folder)
  if stale and not overwrite:
    raise errors.ConfigError(
        f"{folder} already holds {len(stale)} safetensors file(s) ({stale[0]}, ...); pass "
        "--overwrite (overwrite=True) to replace them, or choose another folder.")
  step = checkpoint_step(checkpoint)
  metadata = {"format": FORMAT, "source": os.path.abspath(checkpoint),
              "contents": "weights+optimizer" if include_optimizer else "weights"}
  if step is not None:
    metadata["step"] = str(step)
  shards = _shards(sizes, max_shard_size)
  names = [SAFETENSORS_FILE] if len(shards) == 1 else [
      _SHARD_FILE.format(k + 1, len(shards)) for k in range(len(shards))]
  created = not os.path.exists(folder)
  os.makedirs(folder, exist_ok=True)
  for name in stale:
    os.remove(os.path.join(folder, name))
  written = []
  try:
    for file_name, shard in zip(names, shards):
      tensors = {n: np.ascontiguousarray(reader.get_tensor(keys[n])) for n in shard}
      written.append(file_name)
      safetensors.numpy.save_file(tensors, os.path.join(folder, file_name), metadata=metadata)
      user_mode(os.path.join(folder, file_name))
    if len(shards) > 1:
      written.append(SAFETENSORS_INDEX)
      weight_map = {n: f for f, shard in zip(names, shards) for n in shard}
      fs.write_json_atomic(os.path.join(folder, SAFETENSORS_INDEX), {
          "metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map})
      user_mode(os.path.join(folder, SAFETENSORS_INDEX))
  except BaseException:
    for file_name in written:
      if os.path.exists(os.path.join(folder, file_name)):
        os.remove(os.path.join(folder, file_name))
    if created:
      os.rmdir(folder)
    raise
  return SafetensorsExport(folder, tuple(written), tuple(keys), sum(n for _, n in sizes),
                           step, tuple(left_out))


# -- A tfdp-train checkpoint as a .keras model ------------------------------------


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
           if (named := export_name(key)) and key.startswith(_MODEL_PREFIX)}
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
  """The (uncompiled) model a `tfdp.TrainState` checkpoint's Keras config describes (`tfdp.state.model_config`).

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
