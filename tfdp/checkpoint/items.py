"""What a save writes: a checkpoint's tensors as planner Items, and their host snapshot."""

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.python.training.saving import saveable_object

from tfdp import errors
from tfdp.checkpoint.planner import Item
from tfdp.checkpoint.planner import OBJECT_GRAPH_KEY


def _nbytes(t):
  if t.dtype == tf.string:
    return int(sum(len(b) for b in np.ravel(t.numpy()))) + 8 * max(
        1, int(np.prod(t.shape)))
  return int(np.prod(t.shape, dtype=np.int64)) * t.dtype.size


def gather(checkpoint: tf.train.Checkpoint, key_prefix: str = "",
           with_object_graph: bool = True) -> list[Item]:
  """Returns the Items of `checkpoint`, without copying.

  Uses the same serialization as `tf.train.Checkpoint.write` (object graph
  proto under `_CHECKPOINTABLE_OBJECT_GRAPH`), so the merged result is a
  checkpoint plain TF restores.

  Raises:
    CheckpointError: an object has a registered saver (not supported).
  """
  serialized, _, registered, _ = (
      checkpoint._saver._gather_serialized_tensors(None))  # pylint: disable=protected-access
  if registered:
    raise errors.CheckpointError(
        f"Objects with registered savers ({sorted(registered)}) are not "
        "supported by tfdp.CheckpointManager; save them with tf.train.Checkpoint.")
  items = []
  for tensor_dict in serialized.values():
    for key, slices in tensor_dict.items():
      if key == OBJECT_GRAPH_KEY and not with_object_graph:
        continue
      if not isinstance(slices, dict):
        slices = {"": slices}
      for slice_spec, value in slices.items():
        if isinstance(value, saveable_object.SaveSpec):
          device = value.device
          with tf.device(device if isinstance(device, str) and device else None):
            value = value.tensor
        if value is None:
          continue
        if callable(value) and not isinstance(value, tf.Tensor):
          value = value()
        value = tf.convert_to_tensor(value)
        items.append(Item(key_prefix + key, slice_spec, value, _nbytes(value)))
  items.sort(key=lambda it: (it.key, it.slice_spec))
  return items


def snapshot(items: list[Item]) -> list[Item]:
  """Snapshots the values of `items` in host memory so later updates don't leak in.

  A tensor already in host memory is kept as is: it is the result of a
  ReadVariableOp, and TF's update kernels (assign*, every optimizer apply)
  copy a variable's buffer before writing when a reader still holds it
  (copy-on-write), so it cannot change. Other tensors (GPU/TPU) are copied
  to host memory.
  """
  out = []
  for it in items:
    value = it.value
    if isinstance(value, tf.Tensor) and "CPU" in (value.device or "").upper():
      out.append(it)
      continue
    value = value.numpy() if isinstance(value, tf.Tensor) else value
    out.append(dataclasses.replace(it, value=np.array(value, copy=True)))
  return out
