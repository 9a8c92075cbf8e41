"""TFRecord files read by example index: their record index, and the source that fetches records at any position."""

import os
import struct
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfdp import errors
from tfdp.data.sources import RandomAccessSource


def tfrecord_index(paths: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(file, offset, length) of every record of uncompressed TFRecord files, in order.

  Reads only the 12-byte record headers (seeking past the data), once.

  Raises:
    ConfigError: a file is not an uncompressed TFRecord file.
  """
  files, offsets, lengths = [], [], []
  for file_id, path in enumerate(paths):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      pos = 0
      while pos < size:
        header = f.read(12)
        length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else -1
        if length < 0 or pos + 12 + length + 4 > size:
          raise errors.ConfigError(
              f"{path} is not an uncompressed TFRecord file (bad record header at "
              f"byte {pos}); random access needs uncompressed records. For "
              "compressed files use tfdp.data.DatasetSource(lambda: "
              "tf.data.TFRecordDataset(paths, compression_type=...).map(parse), "
              "num_examples=...), which resumes by skipping (O(k)).")
        files.append(file_id)
        offsets.append(pos + 12)
        lengths.append(length)
        pos += 12 + length + 4
        f.seek(pos)
  return (np.asarray(files, np.int64), np.asarray(offsets, np.int64),
          np.asarray(lengths, np.int64))


class TFRecordSource(RandomAccessSource):
  """Records of uncompressed TFRecord files, read at any position in O(1).

  An index of record offsets (`tfrecord_index`, built once when the source
  is made) turns example i into one seek and read, so resuming at step k
  reads no record before it. Example i is the i-th record of `paths` taken
  in order.

  Args:
    paths: TFRecord files (a list, or one path).
    parse: `fn(records) -> batched structure`, records being a string
      vector, e.g. `lambda r: tf.io.parse_example(r, features)`.
    name: identity of the data, recorded in checkpoints (default: the file
      names and the record count).
  """

  def __init__(self, paths: str | os.PathLike | list, parse: Callable[[tf.Tensor], Any],
               name: str | None = None):
    self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not self.paths:
      raise errors.ConfigError("TFRecordSource needs at least one file.")
    self.paths = [os.fspath(p) for p in self.paths]
    self.parse = parse
    self._files, self._offsets, self._lengths = tfrecord_index(self.paths)
    self.name = name or "tfrecord:{}:{}".format(
        ",".join(os.path.basename(p) for p in self.paths), self.num_examples)

  @property
  def num_examples(self) -> int:
    return len(self._offsets)

  def _read(self, indices):
    out = np.empty(len(indices), dtype=object)
    order = np.argsort(self._files[indices], kind="stable")
    handle, current = None, None
    try:
      for j in order:
        i = indices[j]
        file_id = self._files[i]
        if file_id != current:
          if handle:
            handle.close()
          handle, current = open(self.paths[file_id], "rb"), file_id
        handle.seek(self._offsets[i])
        out[j] = handle.read(self._lengths[i])
    finally:
      if handle:
        handle.close()
    return out

  def fetch(self, indices: tf.Tensor) -> Any:
    records = tf.numpy_function(self._read, [indices], tf.string, stateful=False)
    records.set_shape([None])
    return self.parse(records)
