"""The file-system seam of checkpoints: fsync, atomic writes and renames, listing, deletion, JSON.

No TensorFlow at import: local paths are read, written atomically and
deleted with the OS's calls (so `tfdp-ckpt ls` runs without TensorFlow);
URLs, renames and trees go through tf.io.gfile, imported on first use.
"""

import json
import os
import sys

from tfdp import errors
from tfdp.checkpoint.format import layout
from tfdp.checkpoint.format import private

# Every function takes a local path or any tf.io.gfile URL. Object stores
# (gs://, s3://) make an object durable when it is closed and have no
# directories to fsync; their rename is a copy, which is why the commit point
# is a small file written last, not a renamed directory.


def is_local(path: str) -> bool:
  """True for paths of the local file system (fsync applies)."""
  return "://" not in path or path.startswith("file://")


def _local(path):
  return path[len("file://"):] if path.startswith("file://") else path


def _gfile():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (not at import: see the docstring)
  return tf.io.gfile


def failures() -> tuple[type[BaseException], ...]:
  """What a failed file operation raises: OSError, and TF's OpError once TensorFlow is loaded."""
  tf = sys.modules.get("tensorflow")
  return (OSError,) + ((tf.errors.OpError,) if tf is not None else ())


def fsync_file(path: str) -> None:
  """Flushes `path` to stable storage (no-op for object stores: close is durable)."""
  if not is_local(path):
    return
  fd = os.open(_local(path), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def restrict(path: str) -> None:
  """Makes a local file tfdp had TensorFlow write 0600 (private.file_mode); TF's writers follow the umask."""
  if is_local(path):
    fd = private.open_file(_local(path), os.O_RDONLY)
    try:
      os.fchmod(fd, private.file_mode())
    finally:
      os.close(fd)


def fsync_dir(path: str) -> None:
  """Makes renames and creations inside directory `path` durable."""
  if not is_local(path):
    return
  try:
    fd = os.open(_local(path), os.O_RDONLY | os.O_DIRECTORY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_atomic(path: str, text, tmp: str | None = None, durable: bool = True) -> None:
  """Writes `text` to `path` so readers see all of it or nothing (temp, fsync, rename).

  Args:
    path: the file.
    text: a str, bytes, or a list of buffers written in turn.
    tmp: the temporary name (default: `layout.atomic_tmp_path(path)`; a
      torn write's leftover a cleanup knows).
    durable: fsync the file and its folder (False: a file in host memory,
      the local tier's, whose rename alone makes it whole).
  """
  tmp = tmp or layout.atomic_tmp_path(path)
  parts = [text.encode()] if isinstance(text, str) else [text] if isinstance(
      text, (bytes, bytearray, memoryview)) else list(text)
  if is_local(path):  # The OS's calls: a local save's record at every step costs little.
    fd = private.open_tmp(_local(tmp))  # 0600, O_EXCL, O_NOFOLLOW: nothing planted is written.
    try:
      for part in parts:
        data = memoryview(part).cast("B")
        while data:
          data = data[os.write(fd, data):]
      if durable:
        os.fsync(fd)
    finally:
      os.close(fd)
    os.replace(_local(tmp), _local(path))
  else:
    with _gfile().GFile(tmp, "wb") as f:
      for part in parts:
        f.write(bytes(part))
    _gfile().rename(tmp, path, overwrite=True)
  if durable:
    fsync_dir(os.path.dirname(path))


def write_json_atomic(path: str, obj, durable: bool = True) -> None:
  """Writes `obj` as JSON to `path`, atomically (see write_atomic; `durable=False`: no fsync)."""
  write_atomic(path, json.dumps(obj, sort_keys=True), durable=durable)  # One line: C encoder.


def read_text(path: str) -> str | None:
  """The text of file `path`, or None when it does not exist."""
  if is_local(path):
    try:
      with open(_local(path), encoding="utf-8") as f:
        return f.read()
    except FileNotFoundError:
      return None
  gfile = _gfile()
  if not gfile.exists(path):
    return None
  with gfile.GFile(path, "r") as f:
    return f.read()


def open_binary(path: str):
  """`path` open for reading bytes (a context manager)."""
  return open(_local(path), "rb") if is_local(path) else _gfile().GFile(path, "rb")


def read_json(path: str | None):
  """Reads a JSON file; None if there is no path or file, or it is not complete JSON."""
  if not path:
    return None
  try:
    text = read_text(path)
    return None if text is None else json.loads(text)
  except (ValueError, UnicodeDecodeError):
    return None


def listdir(path: str) -> list[str]:
  """Names in directory `path` (without a trailing '/'); [] when it does not exist."""
  if is_local(path):
    try:
      return os.listdir(_local(path))
    except (FileNotFoundError, NotADirectoryError):
      return []
  gfile = _gfile()
  if not gfile.isdir(path):
    return []
  return [n.rstrip("/") for n in gfile.listdir(path)]


def exists(path: str) -> bool:
  return os.path.exists(_local(path)) if is_local(path) else _gfile().exists(path)


def isdir(path: str) -> bool:
  return os.path.isdir(_local(path)) if is_local(path) else _gfile().isdir(path)


def size(path: str) -> int:
  return os.path.getsize(_local(path)) if is_local(path) else _gfile().stat(path).length


def makedirs(path: str) -> None:
  """Makes directory `path` and its missing parents; local ones tfdp makes are 0700 (private.dir_mode)."""
  if not is_local(path):
    _gfile().makedirs(path)
    return
  private.make_dirs(_local(path))


def make_private_dir(path: str) -> None:
  """Makes a worker's local-tier folder, private to this user, or refuses it (private.tier_dir).

  Raises:
    ConfigError: a component is a symlink, another user's, or open to others.
  """
  private.tier_dir(_local(path))


def rename(src: str, dst: str) -> None:
  _gfile().rename(src, dst, overwrite=True)


def remove(path: str) -> None:
  if is_local(path):  # The local tier prunes at every save: the OS's call.
    os.remove(_local(path))
  else:
    _gfile().remove(path)


def rmtree(path: str) -> None:
  _gfile().rmtree(path)


def require_directory(path: str) -> str:
  """`path`, unless it is a local file (ConfigError: a directory is needed; it is made if missing)."""
  if is_local(path) and os.path.isfile(_local(path)):
    raise errors.ConfigError(
        f"{path} is a file, not a directory: pass a directory for the checkpoints "
        "(it is created if missing).")
  return path


def free_bytes(path: str) -> int | None:
  """Bytes free for an unprivileged writer at local `path` (None for object stores, or unknown)."""
  if not is_local(path):
    return None
  try:
    st = os.statvfs(_local(path))
  except OSError:
    return None
  return st.f_bavail * st.f_frsize


def _umask() -> int:
  """This process's umask (Linux: from /proc, as setting it to read it races other threads)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      return int(next(l for l in f if l.startswith("Umask:")).split()[1], 8)
  except (OSError, StopIteration, ValueError):
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def user_mode(path: str) -> None:
  """Gives a local file the mode `open()` gives: 0666 less the umask (`safetensors` and `mkstemp` give 0600)."""
  if "://" not in path:
    os.chmod(path, 0o666 & ~_umask())
