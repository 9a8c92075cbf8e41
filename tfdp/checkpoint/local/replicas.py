"""The per-worker states a worker keeps of its left neighbour, one file each: whole or absent."""

import os
import struct
import threading

from absl import logging

from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import private
from tfdp.checkpoint.local import wire


class Replicas:
  """`<local dir>/peer-<source>/<name>-<step>`: a neighbour's per-worker state at a step.

  Each is one file in the side channel's framing (a JSON header, then the
  tensors' bytes), written to a temp name and renamed. Paths come from
  Layout and integers only (`source` and `step` are checked before any
  path is made).

  Args:
    directory: this worker's local-tier folder.
    name: the checkpoint name.
  """

  def __init__(self, directory: str, name: str):
    self.directory, self.name = directory, name
    self._lock = threading.Lock()

  def _path(self, source: int, step: int) -> str:
    if not (wire._is_int(source) and source >= 0 and wire._is_int(step) and step >= 0):  # pylint: disable=protected-access
      raise ValueError(f"not a worker and a step: {source!r}, {step!r}")
    return layout_lib.peer_copy_path(self.directory, source, self.name, step)

  def put(self, source: int, step: int, header: dict, blobs) -> None:
    """Keeps `source`'s per-worker state at `step` (the fields of a checked PER_WORKER header)."""
    path = self._path(source, step)
    record = {k: header[k] for k in ("keys", "token", "world_size")}
    with self._lock:
      try:
        os.mkdir(os.path.dirname(path), private.dir_mode())
      except FileExistsError:
        pass
      fs.write_atomic(path, wire.frame(dict(record, step=step, source=source), blobs),
                      durable=False)  # 0600, O_EXCL, O_NOFOLLOW; in host memory: no fsync.

  def steps(self, source: int) -> list[int]:
    """The steps of `source`'s per-worker state held here, oldest first."""
    folder = layout_lib.peer_dir(self.directory, source)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(s for s in (layout_lib.peer_copy_step(n, self.name) for n in names)
                  if s is not None)

  def get(self, source: int, step: int) -> tuple[dict, list] | None:
    """(description, blobs) of `source`'s per-worker state at `step`, or None (absent, torn or malformed).

    A file that is not what `put` wrote (cut short, planted, or of another
    version) is treated like a corrupt copy: None, never an exception.
    """
    try:
      with os.fdopen(private.open_file(self._path(source, step), os.O_RDONLY), "rb") as f:
        raw = f.read()
      (n,) = struct.unpack("<Q", raw[:8])
      header = wire.parse_header(raw[8:8 + n])
      sizes, keys = header.get("sizes"), header.get("keys")
      if (not isinstance(sizes, list) or not isinstance(keys, list) or len(keys) != len(sizes)
          or not all(wire._is_int(s) and s >= 0 for s in sizes)  # pylint: disable=protected-access
          or not all(isinstance(k, str) for k in keys) or not isinstance(header.get("token"), str)
          or 8 + n + sum(sizes) != len(raw)):
        raise ValueError("not a kept per-worker state")
    except (OSError, ValueError, struct.error, wire.Refused):
      logging.warning("tfdp: %s is not a whole per-worker state; it is not used.",
                      self._path(source, step))
      return None
    blobs, at = [], 8 + n
    for size in sizes:
      blobs.append(raw[at:at + size])
      at += size
    return header, blobs

  def delete(self, source: int, step: int) -> None:
    with self._lock:
      try:
        os.remove(self._path(source, step))
      except OSError:
        pass

  def sources(self) -> list[int]:
    return layout_lib.peer_sources(self.directory)

  def cleanup(self) -> None:
    """Removes what a write cut short left (temp files, and anything else that is not a kept state)."""
    for source in self.sources():
      folder = layout_lib.peer_dir(self.directory, source)
      for n in os.listdir(folder):
        if layout_lib.peer_copy_step(n, self.name) is None:
          logging.info("tfdp: removing %s (left by a per-worker state cut short)", n)
          try:
            os.remove(os.path.join(folder, n))
          except OSError:
            pass

  def drop(self) -> None:
    """Deletes every per-worker state held here."""
    with self._lock:
      for source in self.sources():
        folder = layout_lib.peer_dir(self.directory, source)
        for n in os.listdir(folder):
          os.remove(os.path.join(folder, n))
        os.rmdir(folder)
