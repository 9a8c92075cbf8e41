"""One tf.data iterator's position: capture it as a variant, turn it into bytes, restore or replay it.

The operations `tfdp.data.iterators` builds its checkpointable iterators on, and
`nondeterminism`, which says why a pipeline's order may differ between runs.
"""

from __future__ import annotations

import re

from absl import logging
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.ops import gen_dataset_ops

from tfdp import errors

# Ops whose state lives in Python (from_generator, py_function): a saved
# position would not hold it, so such a pipeline is not saved at all.
_PYTHON_STATE = ("PyFunc", "EagerPyFunc", "generator")


def capture(resource, dataset) -> tf.Tensor:
  """The iterator's position as the variant tensor tf.data's SerializeIterator returns.

  A snapshot: it holds the buffered elements by reference (tf.data never
  changes them), so the iterator may run on while something else turns it
  into bytes (`tf.io.serialize_tensor`, on a checkpoint's writer thread:
  tfdp.checkpoint.format.items.writable).
  """
  policy = dataset.external_state_policy if dataset is not None else (
      options_lib.ExternalStatePolicy.FAIL)
  try:
    return gen_dataset_ops.serialize_iterator(resource, policy.value)
  except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as e:
    reason = re.sub(r"\{\{.*?\}\}\s*", "", e.message.splitlines()[-1]).split(" [Op:")[0].rstrip(".")
    if "symbolic checkpointing" in e.message:
      raise errors.CheckpointError(
          f"the input pipeline cannot be saved: {reason}. Turn "
          "tf.data.Options().experimental_symbolic_checkpoint off (tf.distribute "
          "rebatches the input for more than one replica with RebatchDatasetV2, "
          "which does not support it).") from None
    if "stateful" not in e.message or any(op in e.message for op in _PYTHON_STATE):
      raise errors.CheckpointError(
          f"the input pipeline cannot be saved: {reason}. A transformation keeps "
          "its state in Python (from_generator, py_function) or elsewhere tf.data "
          "cannot serialize.") from None
    # A stateful op such as tf.image.random_flip_*: the position is saved
    # exactly, that op's random state is not.
    if dataset is not None and not getattr(dataset, "_warned_stateful", False):
      dataset._warned_stateful = True  # pylint: disable=protected-access
      logging.warning(
          "tfdp: %s; saving the data position without that op's random state, so "
          "after a resume its random numbers differ from an uninterrupted run's. "
          "For a bitwise resume use tf.random.stateless_* ops seeded from the "
          "element, or set tf.data.Options().experimental_external_state_policy.",
          reason)
    return gen_dataset_ops.serialize_iterator(
        resource, options_lib.ExternalStatePolicy.IGNORE.value)


def serialize(resource, dataset) -> tf.Tensor:
  return tf.io.serialize_tensor(capture(resource, dataset))


def restore(resource, state: tf.Tensor) -> None:
  """Moves the iterator to `state`: a captured variant, or its bytes (a string tensor)."""
  if state.dtype == tf.variant:
    gen_dataset_ops.deserialize_iterator(resource, state)
  else:
    deserialize(resource, state.numpy())


def take(iterator, n: int) -> None:
  """Takes `n` elements from a tf.data iterator (fewer when it ends), replaying a position."""
  for _ in range(n):
    try:
      iterator.get_next()
    except (tf.errors.OutOfRangeError, StopIteration):
      return


def deserialize(resource, state: bytes) -> None:
  gen_dataset_ops.deserialize_iterator(resource, tf.io.parse_tensor(state, tf.variant))


_SHUFFLES = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
             "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


def nondeterminism(dataset: tf.data.Dataset) -> list[str]:
  """Why the pipeline's order may differ between two runs (empty: it does not)."""
  reasons = []
  if dataset.options().deterministic is False:
    reasons.append("tf.data.Options().deterministic is False")
  graph = graph_pb2.GraphDef.FromString(
      dataset._as_serialized_graph().numpy())  # pylint: disable=protected-access
  nodes = {n.name: n for n in graph.node}
  for node in graph.node:
    if "deterministic" in node.attr and node.attr["deterministic"].s == b"false":
      reasons.append(f"{node.op} has deterministic=False")
    if node.op in _SHUFFLES:
      seeds = [nodes.get(name.split(":")[0]) for name in node.input[2:4]]
      if all(n is not None and n.op == "Const" and
             not tf.make_ndarray(n.attr["value"].tensor).any() for n in seeds):
        reasons.append("shuffle has no seed (and no global seed was set)")
  return sorted(set(reasons))
