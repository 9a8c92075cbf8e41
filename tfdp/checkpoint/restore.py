"""Reading one checkpoint, verified: sizes before any read, TF's per-tensor CRC32C on read, the model it is of, per-worker state."""

import contextlib

from absl import logging
import tensorflow as tf
from tensorflow.python.trackable import trackable_utils

from tfdp import errors
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import verify as verify_lib
from tfdp.checkpoint import model_match

# What TF raises when a checkpoint's bytes are missing, short or wrong.
CORRUPT_ERRORS = (tf.errors.DataLossError, tf.errors.OutOfRangeError,
            tf.errors.NotFoundError, IndexError)
# Errors of reading a checkpoint that another attempt, or an older
# checkpoint, may not have; anything else (e.g. a checkpoint of another
# model) is the caller's to see.
UNREADABLE_ERRORS = (errors.CorruptCheckpointError, OSError, tf.errors.UnavailableError,
               tf.errors.DeadlineExceededError, tf.errors.AbortedError,
               tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
               tf.errors.UnknownError, tf.errors.InternalError)

# Seconds to wait before each retry of a read that failed without proof of
# damage (a transient I/O error) on this worker, before the checkpoint is
# given up for this run.
READ_RETRIES = (0.2, 1.0)



def check_sizes(prefix: str, man: manifest_lib.Manifest | None) -> None:
  """Checks that every file is there with its size, reading no checkpoint bytes.

  A checkpoint without a manifest (TF's own) needs its index.

  Raises:
    CorruptCheckpointError: naming the file.
  """
  if man is not None:
    verify_lib.verify(prefix, man, checksums=False)
    return
  check_manifest(prefix, man)
  if not tf.io.gfile.exists(layout_lib.index_path(prefix)):
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: {layout_lib.index_path(prefix)}: missing.")


def check_manifest(prefix: str, man: manifest_lib.Manifest | None) -> None:
  """Raises CorruptCheckpointError when `prefix` has a manifest file that does not parse (`man` None).

  Only tfdp writes a manifest, atomically: one that is there and does not
  parse is damaged, and so is the commit it records. A checkpoint with no
  manifest at all is TF's own.
  """
  path = layout_lib.manifest_path(prefix)
  if man is None and tf.io.gfile.exists(path):
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: {path}: not a readable manifest.")


def restore_verified(checkpoint: tf.train.Checkpoint, prefix: str,
                     man: manifest_lib.Manifest | None):
  """`checkpoint.restore(prefix)`, with any damage raised as CorruptCheckpointError.

  TF's restore verifies each tensor's CRC32C as it reads it; only when it
  fails are the files checked one by one, to name the bad one (checking
  every file first would read the whole state twice).

  Returns:
    The load status of `tf.train.Checkpoint.restore`.
  """
  with verified_read(prefix, man):
    return checkpoint.restore(prefix)


@contextlib.contextmanager
def verified_read(prefix: str, man: manifest_lib.Manifest | None):
  """Any error of reading `prefix` inside the block is raised as CorruptCheckpointError when its files are damaged.

  A read of the variables, of a per-worker state (the data position, the
  callbacks' state) or of the index: whatever TF raised, the files are
  checked against the manifest, and a problem found makes it corruption;
  other errors (a transient I/O error, another model) propagate as they are.
  """
  try:
    yield
  except errors.CheckpointError:
    raise
  except (tf.errors.OpError, IndexError, ValueError) as e:
    # A bad CRC32C is a DataLossError for a variable but a plain OpError for
    # the object graph (TF's py_checkpoint_reader), so any error gets the
    # files checked; corrupt only if they fail (or TF says data loss).
    problems = verify_lib.check_files(prefix, man) if man is not None else []
    if not problems and not isinstance(e, CORRUPT_ERRORS):
      raise
    raise errors.CorruptCheckpointError(
        f"Checkpoint {prefix} is corrupt: "
        + ("; ".join(problems) + ". " if problems else "")
        + f"TensorFlow could not read it: {e}") from e


def restore_matched(checkpoint: tf.train.Checkpoint, prefix: str,
                    man: manifest_lib.Manifest | None, match: model_match.ModelMatch) -> None:
  """Restores what `match` says matches of `prefix` (under its keys there); the other objects keep their values.

  Every tensor is read (its CRC32C checked) before anything is assigned;
  the object graph too, so that a damaged one is found as TF's restore finds it.
  """
  with verified_read(prefix, man):
    reader = tf.train.load_checkpoint(prefix)
    if reader.has_tensor(items_lib.OBJECT_GRAPH_KEY):
      reader.get_tensor(items_lib.OBJECT_GRAPH_KEY)
    values = {}
    for it in items_lib.gather(checkpoint, with_object_graph=False):
      there = match.keys.get(it.key, it.key)
      if reader.has_tensor(there):
        values[it.key] = reader.get_tensor(there)
  if not items_lib.restore_values(checkpoint, values, partial=bool(match.differences)):
    raise errors.CheckpointError(
        f"{prefix}: its tensors match this checkpoint's objects only under other names, and "
        "they cannot be assigned so (sliced variables); restore it with TensorFlow "
        "(tf.train.Checkpoint.restore).")


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
                       worker: int, man: manifest_lib.Manifest | None, reader=None) -> None:
  """Restores worker `worker`'s own per-worker state from `prefix` (see CheckpointManager).

  Args:
    per_worker_ckpt: the per-worker state's checkpoint.
    prefix: the checkpoint.
    worker: whose state.
    man: its manifest, or None.
    reader: what reads its tensors (`has_tensor`, `get_tensor`; default: TF's reader of `prefix`).

  Raises:
    CorruptCheckpointError: a tensor of it is damaged (nothing of the state
      read so far is assigned).
  """
  with verified_read(prefix, man):
    _restore_per_worker(per_worker_ckpt, prefix, worker, man, reader)


def _restore_per_worker(per_worker_ckpt, prefix, worker, man, reader):
  reader = reader or tf.train.load_checkpoint(prefix)
  root = layout_lib.per_worker_prefix(worker)
  serialized, _, _, _ = per_worker_ckpt._saver._gather_serialized_tensors(None)  # pylint: disable=protected-access
  missing, plan = [], []
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
      plan.append((trackable, restored))
  # Every tensor is read (its CRC32C checked) before any object gets its own.
  for trackable, restored in plan:
    trackable._restore_from_tensors(restored)  # pylint: disable=protected-access
  if missing:
    world = man.world_size if man else "?"
    logging.warning(
        "tfdp: %s (written by %s workers) has no per-worker state %s for "
        "worker %d; keeping its initial values. Use "
        "tfdp.checkpoint.load_per_worker() to reshard it.", prefix, world,
        missing, worker)
