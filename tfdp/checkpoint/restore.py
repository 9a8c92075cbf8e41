"""Restoring a checkpoint: sizes before any read, TF's per-tensor CRC32C on read, per-worker state."""

from absl import logging
import tensorflow as tf
from tensorflow.python.trackable import trackable_utils

from tfdp import errors
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib

# What TF raises when a checkpoint's bytes are missing, short or wrong.
_CORRUPT = (tf.errors.DataLossError, tf.errors.OutOfRangeError,
            tf.errors.NotFoundError, IndexError)


def check_sizes(prefix: str, man: manifest_lib.Manifest | None) -> None:
  """Checks that every file is there with its size, reading no checkpoint bytes.

  A checkpoint without a manifest (TF's own) needs its index.

  Raises:
    CorruptCheckpointError: naming the file.
  """
  if man is not None:
    manifest_lib.verify(prefix, man, checksums=False)
  elif not tf.io.gfile.exists(layout_lib.index_path(prefix)):
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: {layout_lib.index_path(prefix)}: missing.")


def restore_verified(checkpoint: tf.train.Checkpoint, prefix: str,
                     man: manifest_lib.Manifest | None):
  """`checkpoint.restore(prefix)`, with any damage raised as CorruptCheckpointError.

  TF's restore verifies each tensor's CRC32C as it reads it; only when it
  fails are the files checked one by one, to name the bad one (checking
  every file first would read the whole state twice).

  Returns:
    The load status of `tf.train.Checkpoint.restore`.
  """
  try:
    return checkpoint.restore(prefix)
  except (tf.errors.OpError, IndexError, ValueError) as e:
    # A bad CRC32C is a DataLossError for a variable but a plain OpError for
    # the object graph (TF's py_checkpoint_reader), so any error gets the
    # files checked; corrupt only if they fail (or TF says data loss).
    problems = manifest_lib.check_files(prefix, man) if man is not None else []
    if not problems and not isinstance(e, _CORRUPT):
      raise
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: "
        + ("; ".join(problems) + ". " if problems else "")
        + f"TensorFlow could not read it: {e}") from e


def load_per_worker(path: str) -> dict:
  """Returns {worker: {key: ndarray}} of the per-worker state saved in `path`.

  For custom resharding of per-worker state (e.g. recomputing data positions
  when the number of workers changed).
  """
  reader = tf.train.load_checkpoint(path)
  out = {}
  root = layout_lib.PER_WORKER_ROOT + "/"
  for key in reader.get_variable_to_shape_map():
    if key.startswith(root):
      worker, _, rest = key[len(root):].partition("/")
      out.setdefault(int(worker), {})[rest] = reader.get_tensor(key)
  return out


def restore_per_worker(per_worker_ckpt: tf.train.Checkpoint, prefix: str,
                       worker: int, man: manifest_lib.Manifest | None) -> None:
  """Restores worker `worker`'s own per-worker state from `prefix` (see CheckpointManager)."""
  reader = tf.train.load_checkpoint(prefix)
  root = layout_lib.per_worker_prefix(worker)
  serialized, _, _, _ = per_worker_ckpt._saver._gather_serialized_tensors(None)  # pylint: disable=protected-access
  missing = []
  for trackable, tensor_dict in serialized.items():
    if trackable is None:
      continue
    restored = {}
    for key, value in tensor_dict.items():
      if isinstance(value, dict):
        raise errors.CheckpointError(
            f"per_worker state {key} is sliced; only unsliced per-worker "
            "state is supported.")
      if not reader.has_tensor(root + key):
        missing.append(key)
        restored = None
        break
      restored[trackable_utils.extract_local_name(key)] = tf.constant(
          reader.get_tensor(root + key))
    if restored:
      trackable._restore_from_tensors(restored)  # pylint: disable=protected-access
  if missing:
    world = man.world_size if man else "?"
    logging.warning(
        "tfdp: %s (written by %s workers) has no per-worker state %s for "
        "worker %d; keeping its initial values. Use "
        "tfdp.checkpoint.load_per_worker() to reshard it.", prefix, world,
        missing, worker)
