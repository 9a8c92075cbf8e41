"""The state of a run's Keras callbacks that a backup holds: the hook for any callback, and Keras's own stateful ones.

A callback's state is what it has learnt from the run so far and that a
resumed `fit` would otherwise start again: `EarlyStopping`'s `wait` and
`best`, `ModelCheckpoint`'s `best`, `ReduceLROnPlateau`'s counters, the rows
`CSVLogger` wrote, `TensorBoard`'s step counters. `tfdp.callbacks.
BackupAndRestore` saves it with every backup (each worker its own) and puts
it back when `fit` resumes, after every callback's `on_train_begin` (which
resets most of them), so the resumed run takes the decisions and writes the
files of the run that never stopped.

Any callback of one's own takes part by defining two methods:

    class MyCallback(keras.callbacks.Callback):
      def get_state(self) -> dict:    # JSON values and NumPy arrays
        return {"seen": self.seen, "history": np.asarray(self.history)}
      def set_state(self, state: dict) -> None:   # called on resume
        self.seen, self.history = state["seen"], list(state["history"])

`get_state` is called at every backup, in the training loop, so it should be
cheap; `set_state` gets back what it returned (NumPy arrays as arrays,
numbers and strings as JSON gives them back). Callbacks are matched by
class and by their order among callbacks of that class.
"""

from __future__ import annotations

import io
import json
import os
import time

from absl import logging
import keras
import numpy as np

from tfdp.resume import fit_hooks
from tfdp.checkpoint.format import fs

FORMAT_VERSION = 1
_ARRAY = "__tfdp_array__"


class _Attributes:
  """A Keras callback whose state is a few attributes (numbers, None, lists of arrays)."""

  def __init__(self, *names):
    self.names = names

  def get(self, cb) -> dict:
    return {n: getattr(cb, n) for n in self.names if hasattr(cb, n)}

  def set(self, cb, state: dict) -> None:
    for name, value in state.items():
      if name in self.names:
        setattr(cb, name, value)


class _CSVLogger:
  """`CSVLogger`: the text this run wrote so far, where it began in the file, and its columns.

  The text is in the backup, so a resumed run puts the file back as it was
  at the backup (without the rows of steps it recomputes) and appends to it,
  whatever the file went through meanwhile; on a worker that writes nowhere
  (tfdp.compat's chief_only_files) the text is empty.
  """

  def start(self, cb) -> None:
    """At train begin, before any row: where this run's text starts in the open file."""
    f = getattr(cb, "csv_file", None)
    cb._tfdp_csv_start = f.tell() if f is not None and not f.closed else 0  # pylint: disable=protected-access

  def get(self, cb) -> dict:
    f = getattr(cb, "csv_file", None)
    start = getattr(cb, "_tfdp_csv_start", 0)
    text = ""
    if f is not None and not f.closed and getattr(f, "name", os.devnull) != os.devnull:
      f.flush()
      with _open(f.name, "rb") as r:  # Bytes: csv writes \r\n line ends.
        r.seek(start)
        text = r.read().decode("utf-8")
    # Once its writer exists, its header is written (or was not wanted).
    wrote = getattr(cb, "writer", None) is not None
    return {"start": start, "text": text, "keys": cb.keys if wrote else None,
            "append_header": False if wrote else bool(cb.append_header)}

  def set(self, cb, state: dict) -> None:
    f = getattr(cb, "csv_file", None)
    if f is None or f.closed:
      return
    path = getattr(f, "name", os.devnull)
    if path != os.devnull:
      f.close()
      with _open(path, "rb") as r:
        before = r.read(int(state["start"]))
      with _open(path, "wb") as w:
        w.write(before + state["text"].encode("utf-8"))
      cb.csv_file = _open(path, "a")
    cb.keys = state["keys"]
    cb.append_header = state["append_header"]
    cb.writer = None  # Made again at the next epoch end, over the file as it is.
    self.start(cb)
    cb._tfdp_csv_start = int(state["start"])  # pylint: disable=protected-access


def _open(path, mode):
  from keras.src.utils import file_utils  # pylint: disable=g-import-not-at-top
  return file_utils.File(path, mode)


class _TensorBoard:
  """`TensorBoard`: its step counters; on resume, the events a lost attempt wrote after the backup go.

  Its counters number the batch summaries, so the resumed run continues the
  curves where the backup left them. Its writers are flushed with every
  backup, so what they logged before it is on disk; the events earlier runs
  wrote after it (the steps the resumed run computes again) are removed
  from their files, so no step is in the log directory twice.
  """

  def get(self, cb) -> dict:
    # Its events up to the backup go to disk with it: a SIGKILL loses what
    # the writers still buffer (up to 10 events or 2 minutes' worth).
    for writer in getattr(cb, "_writers", {}).values():
      writer.flush()
    return {"_global_train_batch": int(cb._global_train_batch),  # pylint: disable=protected-access
            "_global_test_batch": int(cb._global_test_batch),  # pylint: disable=protected-access
            "time": time.time()}

  def set(self, cb, state: dict) -> None:
    cb._global_train_batch = int(state["_global_train_batch"])  # pylint: disable=protected-access
    cb._global_test_batch = int(state["_global_test_batch"])  # pylint: disable=protected-access
    folder = getattr(cb, "_log_write_dir", None)
    run = fit_hooks.current(cb.model)
    if folder and run is not None and getattr(cb, "_tfdp_scratch", None) is None:
      drop_events_after(folder, float(state["time"]), run.started)  # Not a worker writing nowhere.


def drop_events_after(folder: str, wall_time: float, since: float) -> int:
  """Removes the events newer than `wall_time` from the event files under `folder` begun before `since`.

  Files whose first event (after the version record) is from `since` or
  later are the running fit's own. Each file is
  rewritten under a temporary name and renamed over the old one (removed
  when nothing is left); a file torn by a crash is read up to its last
  whole record.

  Returns:
    The number of events removed.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  removed = 0
  # TensorBoard writes into log_dir/train and log_dir/validation.
  for path in (tf.io.gfile.glob(os.path.join(folder, "*tfevents*"))
               + tf.io.gfile.glob(os.path.join(folder, "*", "*tfevents*"))):
    if path.endswith(".tfdp-tmp"):
      continue
    times, records, begun = [], [], None
    try:
      for record in tf.data.TFRecordDataset(path):
        event = event_pb2.Event.FromString(record.numpy())
        records.append(record.numpy())
        times.append(event.wall_time)
        if begun is None and not event.HasField("file_version"):
          begun = event.wall_time  # The version record's time is in whole seconds.
    except tf.errors.DataLossError:
      times.append(float("inf"))  # A torn last record.
    if begun is None or begun >= since or max(times) <= wall_time:
      continue
    kept = [r for r, t in zip(records, times) if t <= wall_time]
    removed += len(times) - len(kept)
    if not kept:
      tf.io.gfile.remove(path)
      continue
    tmp = path + ".tfdp-tmp"
    with tf.io.TFRecordWriter(tmp) as writer:
      for record in kept:
        writer.write(record)
    fs.rename(tmp, path)
  return removed


def _adapters():
  """(class, adapter) of Keras's stateful callbacks, most derived first."""
  cbs = keras.callbacks
  return (
      (cbs.EarlyStopping, _Attributes("wait", "stopped_epoch", "best", "best_epoch",
                                      "best_weights")),
      (cbs.ReduceLROnPlateau, _Attributes("wait", "cooldown_counter", "best")),
      (cbs.ModelCheckpoint, _Attributes("best", "_batches_seen_since_last_saving",
                                        "_last_batch_seen")),
      (cbs.CSVLogger, _CSVLogger()),
      (cbs.TensorBoard, _TensorBoard()),
  )


def adapter_of(cb):
  """How to get and set `cb`'s state: its own get_state/set_state, Keras's own callbacks', or None."""
  if callable(getattr(cb, "get_state", None)) and callable(getattr(cb, "set_state", None)):
    return _Hook()
  for cls, adapter in _adapters():
    if isinstance(cb, cls):
      return adapter
  return None


class _Hook:
  """A callback's own `get_state()` / `set_state(state)`."""

  def get(self, cb) -> dict:
    return cb.get_state()

  def set(self, cb, state: dict) -> None:
    cb.set_state(state)


def keys(callbacks) -> list[tuple[str, object]]:
  """(key, callback) of the callbacks with state: `module.Class#n`, n counting callbacks of that class.

  tfdp's own callbacks (tfdp.app.tensorboard's TensorBoard, keyed by the global
  step) resume from the step; they take part only through the hook.
  """
  seen, out = {}, []
  for cb in callbacks:
    adapter = adapter_of(cb)
    if adapter is None or (type(cb).__module__.startswith("tfdp.")
                           and not isinstance(adapter, _Hook)):
      continue
    name = f"{type(cb).__module__}.{type(cb).__qualname__}"
    out.append((f"{name}#{seen.get(name, 0)}", cb))
    seen[name] = seen.get(name, 0) + 1
  return out


def train_begin(callbacks) -> None:
  """Before any state is taken or set in a `fit`: where each CSVLogger's text starts."""
  for _, cb in keys(callbacks):
    adapter = adapter_of(cb)
    if isinstance(adapter, _CSVLogger):
      adapter.start(cb)


def capture(callbacks) -> tuple[bytes, bytes]:
  """The state of `callbacks` as (JSON, the NumPy arrays it refers to as one .npz); b"" arrays when none."""
  arrays = {}

  def plain(value):
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray) or hasattr(value, "numpy"):  # NumPy, or a tensor
      value = np.asarray(value)
      if value.shape:
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {_ARRAY: name}
    return value.item() if isinstance(value, (np.ndarray, np.generic)) else value

  states = {}
  for key, cb in keys(callbacks):
    try:
      states[key] = plain(adapter_of(cb).get(cb))
      json.dumps(states[key])
    except (TypeError, ValueError) as e:
      states.pop(key, None)
      if not getattr(cb, "_tfdp_state_warned", False):
        cb._tfdp_state_warned = True  # pylint: disable=protected-access
        logging.warning("tfdp: the state of %s is not saved with the backups: its get_state() "
                        "must return a dict of JSON values and NumPy arrays (%s).", key, e)
  text = json.dumps({"version": FORMAT_VERSION, "callbacks": states}, sort_keys=True)
  blob = b""
  if arrays:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    blob = buffer.getvalue()
  return text.encode(), blob


def restore(callbacks, text: bytes, blob: bytes) -> list[str]:
  """Puts a captured state back into `callbacks`; returns the keys restored."""
  saved = json.loads(text.decode() if isinstance(text, bytes) else text) if text else {}
  states = saved.get("callbacks", {})
  arrays = np.load(io.BytesIO(blob)) if blob else {}

  def value(v):
    if isinstance(v, dict) and set(v) == {_ARRAY}:
      return np.array(arrays[v[_ARRAY]])
    if isinstance(v, list):
      return [value(x) for x in v]
    if isinstance(v, dict):
      return {k: value(x) for k, x in v.items()}
    return v

  done = []
  for key, cb in keys(callbacks):
    if key in states:
      adapter_of(cb).set(cb, value(states[key]))
      done.append(key)
  return done
