"""What a save writes: a checkpoint's tensors as planner Items, and their host snapshot."""

import collections
import dataclasses
import threading
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import python_state
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.training.saving import saveable_object

from tfdp.checkpoint.format.planner import Item
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.format.planner import OBJECT_GRAPH_KEY


def number(value) -> int:
  """A step or checkpoint number given as an int, a tf.Variable or a tensor."""
  if isinstance(value, (tf.Variable, tf.Tensor)):
    value = value.numpy()
  return int(value)


def nbytes(t) -> int:
  """Bytes of tensor `t` as a checkpoint holds them (strings: their lengths plus 8 each)."""
  if t.dtype == tf.variant:
    return 0  # Unknown until `writable` turns it into bytes.
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
  return [Item(key, spec, value, nbytes(value))
          for key, spec, value in reads.tensors(checkpoint, key_prefix, with_object_graph)]


def sized(items: list[Item]) -> list[Item]:
  """`items` with every size known (a cached read leaves strings' and its walk's unsized)."""
  return [it if it.nbytes is not None else dataclasses.replace(it, nbytes=nbytes(it.value))
          for it in items]


def restore_values(checkpoint: tf.train.Checkpoint, values: dict, partial: bool = False,
                   times=None) -> bool:
  """Assigns `values` ({key: array}) to `checkpoint`'s objects, as TF's restore would, if they match exactly.

  Each object gets its tensors through its own `_restore_from_tensors`
  (what TF's restore calls), so distributed variables, Python state and
  the rest restore as they do from a TF checkpoint. Nothing is assigned,
  and False returned, when `values` holds a key no object of `checkpoint`
  saves now, an object has some of its keys and not all, or a dtype or
  shape differs (TF's restore then defers or reports it).

  With `partial`, an object whose tensors are not all in `values` with
  their dtype and shape keeps its values instead (and so does every Python
  state, e.g. the model's config: this run's stays), keys no object saves
  are left, and True is returned. `times` (tfdp.checkpoint.local.phases.PhaseTimes,
  or None) gets the seconds of `plan`, `tensors` and `assign`.
  """
  start = time.perf_counter()
  serialized, _, registered, _ = checkpoint._saver._gather_serialized_tensors(None)  # pylint: disable=protected-access
  if registered:
    return False
  plan, seen = [], set()
  for trackable, tensor_dict in serialized.items():
    present = [k for k in tensor_dict if k in values]
    if trackable is None or not present or (
        partial and isinstance(trackable, python_state.PythonState)):
      continue  # An object the copy does not hold keeps its values, as TF's restore leaves it.
    if len(present) != len(tensor_dict) or not (
        isinstance(trackable, python_state.PythonState) or type(trackable)._restore_from_tensors  # pylint: disable=protected-access
        is not trackable_base.Trackable._restore_from_tensors):  # pylint: disable=protected-access
      if partial:
        continue
      return False
    names = {}
    for key, value in tensor_dict.items():
      if isinstance(value, dict):
        names = None  # Sliced.
        break
      if isinstance(value, saveable_object.SaveSpec):
        value = value.tensor
      value = value() if callable(value) and not isinstance(value, tf.Tensor) else value
      got = np.asarray(values[key])
      kind = tf.string if got.dtype.kind in "OS" else tf.as_dtype(got.dtype)
      if value is None or tf.as_dtype(value.dtype) != kind or list(value.shape) != list(got.shape):
        names = None
        break
      names[trackable_utils.extract_local_name(key)] = key
    if names is None:
      if partial:
        continue
      return False
    plan.append((trackable, names))
    seen.update(tensor_dict)
  if not partial and set(values) - seen - {OBJECT_GRAPH_KEY}:
    return False
  seconds = {"plan": time.perf_counter() - start, "tensors": 0.0, "assign": 0.0}
  for trackable, names in plan:
    if isinstance(trackable, python_state.PythonState):  # As TF's restore: its string, as is.
      (key,) = names.values()
      trackable.deserialize(values[key])
      continue
    start = time.perf_counter()
    tensors = {name: tf.constant(values[key]) for name, key in names.items()}
    made = time.perf_counter()
    trackable._restore_from_tensors(tensors)  # pylint: disable=protected-access
    seconds["tensors"] += made - start
    seconds["assign"] += time.perf_counter() - made
  if times is not None:
    for phase, value in seconds.items():
      times.add(phase, value)
  return True


class PerWorker:
  """One worker's per-worker state: name -> trackable, saved under `_tfdp_per_worker/<worker>/`.

  Args:
    objects: name -> trackable whose values differ between workers.
    worker: this worker's index.
  """

  def __init__(self, objects: dict | None, worker: int):
    self.objects = dict(objects or {})
    self.worker = worker
    self.checkpoint = tf.train.Checkpoint(**self.objects) if self.objects else None
    self._walk = (reads.CachedWalk(self.checkpoint, layout_lib.per_worker_prefix(worker))
                  if self.objects else None)

  @property
  def keys(self) -> list[str]:
    return sorted(self.objects)

  @property
  def required(self) -> bool:
    """Whether a copy's per-worker state must be restored exactly (each object's `tfdp_required`)."""
    return any(getattr(obj, "tfdp_required", True) for obj in self.objects.values())

  def items(self, cached: bool = False) -> list[Item]:
    """The state as Items under this worker's keys ([] when there is none).

    `cached`: without walking the object graph, unsized (see
    `tfdp.checkpoint.format.reads.CachedWalk`; `check()` first where the
    objects may have changed). Otherwise a full read, sized.
    """
    if self.checkpoint is None:
      return []
    if cached:
      return self._walk()
    return gather(self.checkpoint, layout_lib.per_worker_prefix(self.worker),
                  with_object_graph=False)

  def check(self) -> None:
    """The cached reads walk again at their next call if the objects changed."""
    if self._walk is not None:
      self._walk.check()


# The bytes of the last variants written: a data position is saved against
# the same iterator state for many saves (tfdp.resume), made into bytes once.
_bytes_of = collections.OrderedDict()
_bytes_lock = threading.Lock()


def writable(value) -> tf.Tensor:
  """`value` as the tensor a checkpoint file holds: a variant (an iterator's position) becomes its bytes.

  The writer calls it, so a save's blocking part takes variants as they are.
  """
  if not isinstance(value, tf.Tensor):  # A tensor as is: the writer asks for each one at every save.
    value = tf.convert_to_tensor(value)
  if value.dtype.name != "variant":  # A DType comparison costs ~2 us, at every tensor of every save.
    return value
  # Held while the bytes are made: the persistent and the local writer of
  # one step then make them once.
  with _bytes_lock:
    hit = _bytes_of.get(id(value))
    if hit is not None and hit[0] is value:
      return hit[1]
    out = tf.io.serialize_tensor(value)
    _bytes_of[id(value)] = (value, out)  # Holds `value`, so its id stays its own.
    while len(_bytes_of) > 4:
      _bytes_of.popitem(last=False)
  return out


class HostMirrors:
  """Host buffers reused by every save for the tensors that live on a device (GPU), as TF's async checkpoint has.

  One CPU variable per device tensor, made at the first save (outside any
  strategy: a plain resource variable); each save assigns the tensor to it
  (the device-to-host copy, into the same memory every time) and hands on
  an alias of it. A save that comes while the writer still reads the
  previous one's makes TF copy that buffer first (copy-on-write).
  """

  def __init__(self):
    self._vars = {}

  def __call__(self, key, value):
    mirror = self._vars.get(key)
    if mirror is None or mirror.dtype != value.dtype or mirror.shape != value.shape:
      with tf.init_scope(), tf.device("/cpu:0"):
        mirror = resource_variable_ops.UninitializedVariable(
            shape=value.shape, dtype=value.dtype, trainable=False, name="tfdp_host_mirror")
      self._vars[key] = mirror
    mirror.assign(value)
    return mirror.read_value()


def snapshot(items: list[Item], mirrors: HostMirrors | None = None) -> list[Item]:
  """Snapshots the values of `items` in host memory so later updates don't leak in.

  A tensor already in host memory is kept as is: it is the result of a
  ReadVariableOp, an alias of the variable's buffer, and TF's update kernels
  (assign*, every optimizer apply) copy a variable's buffer before writing
  when a reader still holds it (copy-on-write), so it cannot change; the
  local tier's writer lets it go as soon as its bytes are in the slot.
  Other tensors (GPU/TPU) are copied to host memory once: into `mirrors`
  (reused) when given, else into memory TF allocates.
  """
  out = []
  for it in items:
    value = it.value
    if isinstance(value, tf.Tensor) and "CPU" in (value.device or "").upper():
      out.append(it)
      continue
    if mirrors is not None and isinstance(value, tf.Tensor) and value.dtype not in (
        tf.string, tf.variant, tf.resource):
      out.append(dataclasses.replace(it, value=mirrors((it.key, it.slice_spec), value)))
      continue
    if isinstance(value, tf.Tensor) and value.dtype not in (tf.string, tf.variant):
      value = value._numpy()  # pylint: disable=protected-access
    elif isinstance(value, tf.Tensor):
      value = value.numpy()
    out.append(dataclasses.replace(it, value=np.array(value, copy=True)
                                   if not isinstance(value, np.ndarray) else value))
  return out
