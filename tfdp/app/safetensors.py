"""A checkpoint's tensors as Hugging Face safetensors files, named by their Keras variable paths."""

from __future__ import annotations

import dataclasses
import fnmatch
import os

import numpy as np

from tfdp import errors
from tfdp.resume import train_state as state_lib
from tfdp.checkpoint.format import fs

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

MODEL_PREFIX = "model/"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
# Keras names the state variable of every SeedGenerator (dropout, augmentation) so.
_RNG_STATE = "seed_generator_state"
_DTYPES = frozenset(("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32",
                     "uint64", "int64", "float16", "bfloat16", "float32", "float64"))


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
  if path.startswith(MODEL_PREFIX):
    path = path[len(MODEL_PREFIX):]
    return path, path.rsplit("/", 1)[-1] != _RNG_STATE
  if path.startswith(OPTIMIZER_PREFIX):
    return path, False
  return None


def checkpoint_step(checkpoint: str) -> int | None:
  """The global step of a checkpoint: its optimizer's iteration count (a `tfdp.TrainState`'s), else its manifest's step."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
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
        f"{checkpoint}: holds no model variables (keys under {MODEL_PREFIX}); "
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
      fs.user_mode(os.path.join(folder, file_name))
    if len(shards) > 1:
      written.append(SAFETENSORS_INDEX)
      weight_map = {n: f for f, shard in zip(names, shards) for n in shard}
      fs.write_json_atomic(os.path.join(folder, SAFETENSORS_INDEX), {
          "metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map})
      fs.user_mode(os.path.join(folder, SAFETENSORS_INDEX))
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
