"""Restoring a checkpoint: sizes before any read, TF's per-tensor CRC32C on read, per-worker state."""

import dataclasses

from absl import logging
import tensorflow as tf
from tensorflow.python.trackable import trackable_utils

from tfdp import errors
from tfdp.checkpoint import catalog as catalog_lib
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import manifest as manifest_lib
from tfdp.checkpoint import storage

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


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore restored: its prefix, manifest (None: TF's own) and tier."""
  prefix: str
  manifest: manifest_lib.Manifest | None
  tier: str  # "persistent", "local" (each worker's own copy) or "peer".


class Restorer:
  """Restores from one checkpoint directory: intact candidates, the verified read, per-worker state, set aside.

  Args:
    checkpoint: the `tf.train.Checkpoint` to restore into.
    layout: the directory's layout.
    catalog: the directory's `tfdp.checkpoint.catalog.Catalog`.
    me: this worker (`tfdp.cluster.Worker`).
    per_worker: a `tf.train.Checkpoint` of this worker's per-worker state, or None.
    verify_sizes: check every file's size before a restore reads it.
    lease: the chief's `tfdp.checkpoint.lease.Holder`: it holds the lease
      before it sets a checkpoint aside.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, layout, catalog, me,
               per_worker: tf.train.Checkpoint | None, verify_sizes: bool, lease):
    self._checkpoint = checkpoint
    self._layout = layout
    self._catalog = catalog
    self._me = me
    self._per_worker = per_worker
    self._verify = verify_sizes
    self._lease = lease

  def candidates(self):
    """Yields (prefix, manifest) of the checkpoints, newest first, whose files are all there.

    A checkpoint with a missing or short file is set aside, with a warning.
    """
    for prefix in self._catalog.candidates():
      man = self._catalog.manifest(prefix)
      if self._verify:
        try:
          check_sizes(prefix, man)
        except errors.CorruptCheckpointError as e:
          logging.warning("tfdp: Skipping a corrupt checkpoint: %s", self.set_aside(prefix, e))
          continue
      yield prefix, man

  def newest_step(self) -> int | None:
    """The step of the newest intact checkpoint, or None."""
    for prefix, man in self.candidates():
      return man.step if man is not None else layout_lib.number_of(prefix)
    return None

  def restore(self, prefix: str):
    """Verifies and restores `prefix` and this worker's per-worker state.

    Returns:
      (TF's load status, the manifest or None for TF's own checkpoint).

    Raises:
      CorruptCheckpointError: a file is missing, truncated or corrupt (the
        checkpoint is then set aside).
    """
    man = self._catalog.manifest(prefix)
    try:
      if self._verify:
        check_sizes(prefix, man)
      status = restore_verified(self._checkpoint, prefix, man)
    except errors.CorruptCheckpointError as e:
      raise self.set_aside(prefix, e) from e
    self.restore_per_worker(prefix, man)
    return status, man

  def restore_per_worker(self, prefix: str, man) -> None:
    """This worker's own per-worker state from `prefix` (nothing when there is none)."""
    if self._per_worker is not None:
      restore_per_worker(self._per_worker, prefix, self._me.index, man)

  def newest_intact(self, before_restore=None) -> Restored | None:
    """Restores the newest intact checkpoint; None when there is none.

    Args:
      before_restore: optional `fn(prefix)` called before each restore; its
        exceptions propagate.

    Raises:
      CheckpointError: nothing to restore, but the directory holds
        checkpoints nothing accounts for (see Catalog.check_nothing_unknown).
    """
    for prefix, man in self.candidates():
      try:
        if before_restore is not None:
          before_restore(prefix)
        self.restore(prefix)
        return Restored(prefix, man, "persistent")
      except errors.CorruptCheckpointError as e:
        logging.warning("tfdp: Skipping a corrupt checkpoint: %s", e)
    self._catalog.check_nothing_unknown()
    return None

  def set_aside(self, prefix: str, error: Exception) -> Exception:
    """Takes corrupt checkpoint `prefix` out of the managed ones; returns the error to raise.

    Its manifest becomes `<prefix>.manifest.json.corrupt` (a marker when it
    has none), so a restart does not try it again and training can save past
    its number; its data files go with the next manager's cleanup.
    """
    latest = self._catalog.drop(prefix)
    if latest is False:
      return error
    if self._me.is_chief:
      try:
        self._lease.ensure()
        storage.set_aside(prefix, str(error))
        catalog_lib.write_state(self._layout, self._catalog)
      except tf.errors.OpError as e:
        logging.warning("tfdp: could not set aside %s: %s", prefix, e)
    return errors.CorruptCheckpointError(
        f"{error} It is no longer a committed checkpoint (set aside as "
        f"{layout_lib.corrupt_path(prefix)}); the newest intact one is {latest}.")
