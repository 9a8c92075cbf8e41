"""A checkpoint's tensors read as TF's save reads them: by walking the object graph, or by the cached reads of frequent saves.

A full read (`tensors`) walks the object graph and asks every object for its
tensors, one eager op and some Python per variable (about 0.5 ms each). A
save that comes at every step, or every few, reads the same objects: the
cached reads take the variables in one traced call (`CachedGather`) and
ask the other objects directly (`CachedWalk`), and check that the objects
are still those they were made for with a walk that reads nothing
(`objects_of`, about a tenth of a full read). A `PythonValue` is a number
saved as a variable is, set without a TF op.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import python_state
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.training.saving import saveable_object

from tfdp import errors
from tfdp.checkpoint.format.planner import Item
from tfdp.checkpoint.format.planner import OBJECT_GRAPH_KEY


class PythonValue(trackable_base.Trackable):
  """A number, or a list of numbers, that a checkpoint saves as a variable's value but that lives in Python.

  Saved under `<name>/.ATTRIBUTES/VARIABLE_VALUE`, with its dtype and shape,
  as a `tf.Variable` of that name is: a backup written with either restores
  into the other. Setting it (`assign`) runs no TF op, where a mirrored
  variable's assign runs one per replica (about 0.2 ms each, at every save
  that changed it); its tensor is made once per value, when a save asks.
  The cached reads ask it at every call, as they ask a `PythonState`.

  Args:
    value: the initial value.
    dtype: its dtype (e.g. tf.int64).
  """

  def __init__(self, value, dtype):
    self._dtype = tf.as_dtype(dtype)
    self._saved = None  # (the value, its tensor) of the last save that asked.
    self.assign(value)

  def assign(self, value) -> None:
    """Sets the value: a number, or a (nested) list of numbers; kept as Python numbers."""
    if isinstance(value, tf.Tensor):
      value = value.numpy()
    self._value = value.tolist() if isinstance(value, np.ndarray) else (
        list(value) if isinstance(value, tuple) else value)

  @property
  def value(self):
    """The value as set: a Python number or list (no array is made)."""
    return self._value

  def numpy(self) -> np.ndarray:
    return np.array(self._value, self._dtype.as_numpy_dtype)

  def _serialize_to_tensors(self):
    saved = self._saved
    if saved is None or saved[0] != self._value:
      if tf.executing_eagerly():
        tensor = tf.constant(self._value, self._dtype)
      else:
        with tf.init_scope():  # Eager, also when asked inside a trace.
          tensor = tf.constant(self._value, self._dtype)
      saved = self._saved = (self._value, tensor)
    return {trackable_base.VARIABLE_VALUE_KEY: saved[1]}

  def _restore_from_tensors(self, restored_tensors):
    self.assign(restored_tensors[trackable_base.VARIABLE_VALUE_KEY].numpy())
    return []


def _saves_python_value(trackable) -> bool:
  """Whether `trackable` saves a value that lives in Python (a trace would hold it as a constant of its time)."""
  return isinstance(trackable, (python_state.PythonState, PythonValue))


def tensors(checkpoint, key_prefix="", with_object_graph=True, python_states=True):
  """(key, slice_spec, tensor) of `checkpoint`'s serialization, sorted; eager or inside a tf.function.

  `python_states=False` leaves out the objects that save a Python value
  (`tf.train.experimental.PythonState`, `PythonValue`), whose tensor a
  traced function would hold as a constant of the trace's time.
  """
  serialized, _, registered, _ = (
      checkpoint._saver._gather_serialized_tensors(None))  # pylint: disable=protected-access
  if registered:
    raise errors.CheckpointError(
        f"Objects with registered savers ({sorted(registered)}) are not "
        "supported by tfdp.CheckpointManager; save them with tf.train.Checkpoint.")
  out = []
  for trackable, tensor_dict in serialized.items():
    if not python_states and _saves_python_value(trackable):
      continue
    for key, slices in tensor_dict.items():
      if key == OBJECT_GRAPH_KEY and not with_object_graph:
        continue
      out.extend(values(key_prefix + key, slices))
  out.sort(key=lambda t: (t[0], t[1]))
  return out


def values(key, slices):
  """(key, slice_spec, tensor) of one entry of an object's `_serialize_to_tensors()`, as TF's save reads it."""
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
    yield key, slice_spec, tf.convert_to_tensor(value)


def objects_of(checkpoint) -> tuple:
  """Every object `checkpoint` saves, in the order TF's save walks them (nothing is read)."""
  objects, _ = checkpoint._saver._graph_view._breadth_first_traversal()  # pylint: disable=protected-access
  return tuple(objects)


def _same(a: tuple | None, b: tuple) -> bool:
  return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _python_states(checkpoint, key_prefix):
  """[(key, its name in the object's tensors, the object)] of `checkpoint`'s objects that save a Python value, asked at each save."""
  serialized, _, _, _ = checkpoint._saver._gather_serialized_tensors(None)  # pylint: disable=protected-access
  return [(key_prefix + key, trackable_utils.extract_local_name(key), trackable)
          for trackable, tensor_dict in serialized.items()
          if _saves_python_value(trackable) for key in tensor_dict]


class CachedGather:
  """`tensors(checkpoint)` as one traced TF function, for frequent saves.

  One call reads every variable in one function call (about 0.2 ms for a
  Keras model) instead of one eager op and a graph walk per variable. The
  objects that save a Python value (`PythonState`, `PythonValue`) are asked
  at every call, as TF's save asks them. As TF's own async checkpointing
  does after its first save, the call assumes that the checkpoint's objects
  stay the same; `check()` walks the object graph without reading anything
  and retraces when they changed (a persistent save checks first; a local
  save at every step relies on the last check). The object graph is a
  constant of the trace: every call gives the first call's tensor of it, so
  the local writer, which keeps the bytes of a string by tensor, makes them
  once per trace.

  Args:
    checkpoint: the `tf.train.Checkpoint`.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint):
    self._checkpoint = checkpoint
    self._fn = None
    self._keys = None
    self._states = None
    self._objects = None
    self._texts = {}  # key -> (a Python state's last text, its tensor)
    self._graph = None  # (its index in the outputs, its tensor once read) of this trace.

  def _trace(self):
    keys = []
    self._objects = objects_of(self._checkpoint)
    self._states = _python_states(self._checkpoint, "")

    @tf.function(autograph=False)
    def read():
      keys.clear()
      out = []
      for key, spec, value in tensors(self._checkpoint, python_states=False):
        # Sizes are known from the trace, except those of strings.
        static = (None if value.dtype == tf.string or not value.shape.is_fully_defined()
                  else value.shape.num_elements() * value.dtype.size)
        keys.append((key, spec, static))
        out.append(value)
      return out

    self._fn = read.get_concrete_function()
    self._keys = list(keys)
    at = [i for i, (key, _, _) in enumerate(self._keys) if key == OBJECT_GRAPH_KEY]
    self._graph = (at[0], None) if at else None

  def __call__(self) -> list[Item]:
    """The Items, sized where the trace knew the size (None: a string, sized by whoever needs it)."""
    if self._fn is None:
      self._trace()
    values = self._fn()
    if self._graph is not None:
      at, graph = self._graph
      if graph is None:
        self._graph = (at, values[at])
      else:
        values[at] = graph
    out = [Item(key, spec, value, size)
           for (key, spec, size), value in zip(self._keys, values)]
    if self._states:
      out += [Item(key, "", self._state_tensor(key, name, obj), None)
              for key, name, obj in self._states]
      out.sort(key=lambda it: (it.key, it.slice_spec))
    return out

  def _state_tensor(self, key, name, obj):
    """A Python value's tensor; a Python state's text as a tensor, the last one's again while the text is the same."""
    if isinstance(obj, PythonValue):
      return obj._serialize_to_tensors()[name]  # pylint: disable=protected-access
    text = obj.serialize()
    last = self._texts.get(key)
    if last is None or last[0] != text:
      last = self._texts[key] = (text, tf.constant(text, tf.string))
    return last[1]

  def check(self) -> None:
    """Retraces at the next call when the checkpoint's objects are no longer those of the trace."""
    if self._fn is not None and not _same(self._objects, objects_of(self._checkpoint)):
      self._fn = self._keys = self._states = self._objects = self._graph = None


class CachedWalk:
  """`tensors(checkpoint, key_prefix, with_object_graph=False)` without the object-graph walk, for frequent saves.

  The per-worker state (a data position, callbacks' and metrics' state)
  changes at every step but its objects do not. The first call walks the
  object graph as `tensors` does and keeps each object with its path; later
  calls ask each object for its tensors (its `_serialize_to_tensors`, what
  TF's save asks) and name them as TF's save does. It is made only when
  asking names exactly what the walk named; objects TF saves another way
  (legacy saveables) make every call walk. `check()` walks again at the
  next call when the objects changed. Sizes are left to whoever needs them.

  Args:
    checkpoint: the `tf.train.Checkpoint` of the objects.
    key_prefix: put before every key (a worker's per-worker prefix).
  """

  def __init__(self, checkpoint, key_prefix: str):
    self._checkpoint = checkpoint
    self._prefix = key_prefix
    self._asking = None  # [(object, its path)] of the last walk, or None.
    self._objects = None

  def __call__(self) -> list[Item]:
    return self._walk() if self._asking is None else self._asked()

  def _asked(self) -> list[Item]:
    """The Items from asking each kept object, without a walk."""
    out = []
    for trackable, path in self._asking:
      for name, slices in trackable._serialize_to_tensors().items():  # pylint: disable=protected-access
        key = trackable_utils.checkpoint_key(path, trackable_utils.escape_local_name(name))
        out.extend(values(self._prefix + key, slices))
    out.sort(key=lambda t: (t[0], t[1]))
    return [Item(key, spec, value, None) for key, spec, value in out]

  def _walk(self) -> list[Item]:
    serialized, _, registered, _ = (
        self._checkpoint._saver._gather_serialized_tensors(None))  # pylint: disable=protected-access
    asking = []
    for trackable, tensor_dict in serialized.items():
      keys = [k for k in tensor_dict if k != OBJECT_GRAPH_KEY]
      if not keys:
        continue
      paths = {k.rsplit("/" + trackable_utils.OBJECT_ATTRIBUTES_NAME + "/", 1)[0] for k in keys}
      if (registered or trackable is None or len(paths) != 1
          or type(trackable)._serialize_to_tensors  # pylint: disable=protected-access
          is trackable_base.Trackable._serialize_to_tensors):  # pylint: disable=protected-access
        asking = None
        break
      asking.append((trackable, paths.pop()))
    items = [Item(key, spec, value, None) for key, spec, value in
             tensors(self._checkpoint, self._prefix, with_object_graph=False)]
    self._asking, self._objects = asking, objects_of(self._checkpoint)
    if asking is not None and [(it.key, it.slice_spec) for it in self._asked()] != [
        (it.key, it.slice_spec) for it in items]:
      self._asking = None  # Asking the objects would not name what TF's save names.
    return items

  def check(self) -> None:
    """Walks again at the next call when the objects are no longer those of the last walk."""
    if self._asking is not None and not _same(self._objects, objects_of(self._checkpoint)):
      self._asking = self._objects = None
