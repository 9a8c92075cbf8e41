"""Whether a checkpoint holds a model's tensors: missing, extra, or of another dtype or shape, read from its index alone."""

import collections
import dataclasses
import re

import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib


# How many differences an IncompatibleCheckpointError names.
SHOWN_DIFFERENCES = 3
# Not every checkpoint has a save counter (tf.train.Checkpoint.write's has none).
_OPTIONAL = ("save_counter/.ATTRIBUTES/VARIABLE_VALUE",)
# The numbers Keras appends to automatic names (`dense_3`, `sequential_1`),
# also inside an optimizer's slot names (`sequential_1_dense_3_kernel_momentum`).
_AUTO_NUMBER = re.compile(r"_(\d+)(?=[_/]|$)")


def _name(key: str) -> str:
  """A tensor's key as the differences name it: its object's path."""
  return key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")


def _signature(dtype, shape) -> str:
  return f"{tf.as_dtype(dtype).name} {list(shape)}"


def _renaming(mine, saved) -> dict:
  """{key here: key in the checkpoint} for keys that differ only in Keras's automatic numbers, paired in order.

  A model built again in the same process gets the next automatic names
  (`sequential_1/dense_2` for `sequential/dense`): the keys of the same
  layers, made in the same order, then differ only in those numbers, and
  their order is the layers' (as Keras's own `load_weights` matches by
  structure). Each group of keys equal but for the numbers is paired in
  the numbers' order, when the group differs and both sides have as many.
  """
  groups = collections.defaultdict(lambda: ([], []))
  for side, keys in ((0, mine), (1, saved)):
    for key in keys:
      numbers = tuple(int(n) for n in _AUTO_NUMBER.findall(key))
      groups[_AUTO_NUMBER.sub("", key)][side].append((numbers, key))
  out = {}
  for here, there in groups.values():
    if len(here) == len(there) and {k for _, k in here} != {k for _, k in there}:
      out.update((a, b) for (_, a), (_, b) in zip(sorted(here), sorted(there)))
  return out


@dataclasses.dataclass(frozen=True)
class ModelMatch:
  """How the tensors a checkpoint's objects save match those a checkpoint holds.

  Attributes:
    differences: what differs (a missing or extra tensor, another dtype or
      shape), in words.
    keys: {key here: key in the checkpoint} of those that match under
      another key (see `_renaming`).
  """
  differences: tuple[str, ...] = ()
  keys: dict = dataclasses.field(default_factory=dict)

  @property
  def exact(self) -> bool:
    """Whether TF's own restore restores it whole."""
    return not self.differences and not self.keys


def match_model(checkpoint: tf.train.Checkpoint, prefix: str,
                require_all: bool = False) -> ModelMatch:
  """How the tensors `checkpoint` saves match those checkpoint `prefix` holds (reads its index only).

  A tensor of `checkpoint` that `prefix` lacks, or holds with another dtype
  or shape, is a difference; with `require_all`, so is one `prefix` holds
  that no object of `checkpoint` saves (a removed layer; leave it off when
  objects are made after the restore, which TF restores as they are made).
  Per-worker state is not compared. No difference when `prefix`'s index
  cannot be read (its restore says what is wrong with it).
  """
  try:
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    saved = {k: _signature(dtypes[k], s) for k, s in reader.get_variable_to_shape_map().items()
             if k != items_lib.OBJECT_GRAPH_KEY
             and not k.startswith(layout_lib.PER_WORKER_ROOT + "/")}
  except (tf.errors.OpError, ValueError, IndexError):
    return ModelMatch()
  checkpoint.save_counter  # pylint: disable=pointless-statement  (made as a restore makes it)
  mine = {it.key: _signature(it.value.dtype, it.value.shape)
          for it in items_lib.gather(checkpoint, with_object_graph=False)}
  keys = _renaming(mine, saved)
  out = []
  for key in sorted(mine):
    there = keys.get(key, key)
    if there not in saved and key not in _OPTIONAL:
      out.append(f"{_name(key)} ({mine[key]}) is not in it")
    elif there in saved and saved[there] != mine[key]:
      out.append(f"{_name(key)} is {saved[there]} in it, {mine[key]} here")
  if require_all:
    used = {keys.get(k, k) for k in mine}
    out += [f"{_name(key)} ({saved[key]}) is in it, not in this model" for key in sorted(saved)
            if key not in used]
  return ModelMatch(tuple(out), keys)


def check_model(checkpoint: tf.train.Checkpoint, prefix: str, require_all: bool = False,
                allow_partial: bool = False) -> ModelMatch:
  """Refuses checkpoint `prefix` of another model before anything is assigned.

  Returns:
    The `match_model`; with differences only when `allow_partial` (what
    matches is then restored, the rest keeps its values).

  Raises:
    IncompatibleCheckpointError: `prefix` differs and not `allow_partial`;
      naming it and the first few differences.
  """
  match = match_model(checkpoint, prefix, require_all)
  diffs = match.differences
  if diffs and not allow_partial:
    more = len(diffs) - SHOWN_DIFFERENCES
    raise errors.IncompatibleCheckpointError(
        f"The checkpoint {prefix} is of another model: "
        + "; ".join(diffs[:SHOWN_DIFFERENCES]) + (f"; and {more} more" if more > 0 else "")
        + ". Nothing was restored. Train into another directory, or pass "
        "allow_partial_restore=True to restore what matches.")
  return match
