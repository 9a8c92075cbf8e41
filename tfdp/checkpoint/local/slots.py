"""The local tier's slot files, written: each tensor at a fixed offset, copied and checksummed in one pass.

A worker has COUNT preallocated slot files (tfdp.checkpoint.local.slot_choice
chooses which one a save fills; the committed newest is never written). A
fill copies each tensor's bytes into the slot in chunks and extends the
tensor's CRC32C over each chunk while it is in the cache
(tfdp.checkpoint.format.checksum: C, hardware-accelerated, without the
GIL). The format, its reader and its checks are
tfdp.checkpoint.format.slot_file.
"""

import collections
import dataclasses
import math
import mmap
import os
import struct
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops

from tfdp import errors
from tfdp.checkpoint.format import checksum
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import private
from tfdp.checkpoint.format import slot_file
from tfdp.checkpoint.format.manifest import SlotEntries

COUNT = 2
_ALIGN = 64  # Each tensor's offset: what TF needs to use the bytes in place.
_STRING_ALIGN = 4096


def _string_head(values) -> tuple[bytes, int]:
  """TF's bundle layout of strings: (varint lengths + their masked CRC32C, the CRC so far)."""
  crc, lengths = 0, []
  for v in values:
    n = len(v)
    lengths.append(slot_file.varint(n))
    crc = checksum.extend(crc, slot_file.length_bytes(n))
  check = struct.pack("<I", slot_file.mask(crc))
  return b"".join(lengths) + check, checksum.extend(crc, check)


@dataclasses.dataclass(slots=True)
class _Source:
  """One tensor to write: its record's fields, and its bytes as buffers (`head`: not in the CRC)."""
  key: str
  dtype: str
  shape: list
  size: int
  buffers: list
  crc: int = 0  # Of `head`, for strings.
  head: bytes = b""
  value: object = None  # Kept: a fill may reuse the bytes of the same object.


# String tensors made into bytes lately, by identity, the least recently used
# let go first: a data position saved against one iterator state for many
# saves is the same tensor each time (tfdp.checkpoint.format.items.writable),
# as is the object graph of a traced read (tfdp.checkpoint.format.reads),
# made into bytes once while strings that change at every save come and go.
_strings_of = collections.OrderedDict()
_strings_lock = threading.Lock()


def _string_source(key, value, shape):
  with _strings_lock:
    hit = _strings_of.get(id(value))
    if hit is not None and hit[0] is value:
      _strings_of.move_to_end(id(value))
      return dataclasses.replace(hit[1], key=key)
  raw = value.numpy() if isinstance(value, tf.Tensor) else value
  values = [raw] if isinstance(raw, bytes) else list(np.ravel(raw))
  if not values:
    return _Source(key, "string", shape, 0, [], value=value)
  head, crc = _string_head(values)
  out = _Source(key, "string", shape, len(head) + sum(len(v) for v in values),
                [np.frombuffer(v, np.uint8) for v in values], crc, head, value)
  if isinstance(value, tf.Tensor):
    with _strings_lock:
      _strings_of[id(value)] = (value, out)  # Holds `value`, so its id stays its own.
      while len(_strings_of) > 8:
        _strings_of.popitem(last=False)
  return out


_EagerTensor = ops.EagerTensor
# The fixed-size dtypes a slot holds, by TF's enum: an eager tensor's
# `_datatype_enum()` costs a tenth of its `dtype.name`.
_FIXED = {d.as_datatype_enum: name for name, d in slot_file.DTYPES.items() if name != "string"}
_ITEMSIZE = {name: slot_file.DTYPES[name].size for name in _FIXED.values()}
# Tensors up to this size are copied through a memoryview of the mapping, in
# a fraction of numpy's per-call cost; bigger ones by numpy, which lets the
# GIL go while it copies (as the CRC32C does above 32 KiB).
_SMALL = 64 << 10


def _flat(arr) -> memoryview | np.ndarray:
  """The bytes of C-contiguous array `arr` as one flat buffer (a memoryview: the cheapest to make)."""
  try:
    return memoryview(arr).cast("B")
  except (TypeError, ValueError):  # bfloat16 has no buffer format; an empty array has no cast.
    return arr.reshape(-1).view(np.uint8)


def source(key: str, value) -> _Source:
  """The bytes of `value` (a host tensor or array; strings as TF's bundles hold them), without a copy.

  On a device (GPU) `_numpy()` is the device-to-host copy.
  """
  # The eager tensor's own dtype name and shape tuple, not TensorShape and
  # DType comparisons (about 30 us a tensor, on the writer thread, holding
  # the GIL). A host tensor of a fixed-size dtype does not come here from
  # `Slot.fill`, which writes it without a _Source.
  if isinstance(value, tf.Tensor):
    name, shape = value.dtype.name, list(value._shape_tuple())  # pylint: disable=protected-access
  else:
    name, shape = tf.as_dtype(value.dtype).name, [int(d) for d in value.shape]
  if name == "string":
    return _string_source(key, value, shape)
  if name not in slot_file.DTYPES:
    raise errors.CheckpointError(f"{key}: a {name} tensor cannot be saved in the local tier.")
  arr = value._numpy() if isinstance(value, tf.Tensor) else np.asarray(value)  # pylint: disable=protected-access
  if not arr.flags.c_contiguous:
    arr = np.ascontiguousarray(arr)
  flat = _flat(arr)
  return _Source(key, name, shape, flat.nbytes, [flat], value=value)


def _align(n: int, to: int) -> int:
  return -(-n // to) * to


def _places(keys, sizes, strings, previous, start):
  """{key: (offset, room)}: the previous places when every tensor still fits (fixed offsets), else new ones.

  `strings`: the indices of the string tensors (their rooms leave space to grow).
  """
  if previous and len(previous) == len(keys) and all(
      (p := previous.get(k)) is not None and n <= p[1] and p[0] >= start
      for k, n in zip(keys, sizes)):
    return previous
  places, at = {}, _align(start, _ALIGN)
  # Fixed-size tensors first: a string that grows moves only strings.
  for i in sorted(range(len(keys)), key=lambda i: (i in strings, keys[i])):
    n = sizes[i]
    room = _align(n + n // 16, _STRING_ALIGN) if i in strings else _align(n, _ALIGN)
    places[keys[i]] = (at, room)
    at += room
  return places


def _allocate(fd: int, path: str, start: int, end: int, total: int) -> None:
  """Allocates bytes [start, end) of slot file `fd` (`total`: the size it is made for, named in the error)."""
  try:
    os.posix_fallocate(fd, start, end - start)
  except OSError as e:
    if e.errno not in (95,):  # EOPNOTSUPP: a file system without it.
      raise errors.CheckpointError(
          f"{path}: cannot allocate {total / 1e6:.1f} MB for a local checkpoint slot "
          f"({e}). Free space there or pass another local_checkpoint_dir.") from e
    if os.fstat(fd).st_size < end:
      os.ftruncate(fd, end)


class Slot:
  """One slot file, mapped once and reused by every fill (no allocation per save).

  Args:
    path: the file (from tfdp.checkpoint.format.layout.Layout.slot).
  """

  def __init__(self, path: str):
    self.path = path
    self._fd = None
    self._map = None
    self._view = None
    self._bytes = None
    self._places = {}
    self._memo = {}  # key -> (value, offset, size, crc) of strings written in this slot.
    self._holes = False  # Whether the mapped file may have ranges not allocated (`receivable`).
    self._lock = threading.Lock()

  def _ensure(self, size: int, allocate: bool = True) -> None:
    """Maps the file with at least `size` bytes, allocated (a full tmpfs fails here, not in a write).

    `allocate=False`: not allocated yet (a hole); the caller allocates each
    range before it writes there (`receivable`).
    """
    if self._map is not None and len(self._map) >= size and os.path.exists(self.path):
      if allocate and self._holes:  # Since `receivable`: a cut transfer may have left holes.
        _allocate(self._fd, self.path, 0, len(self._map), len(self._map))
        self._holes = False
      return
    self.close()
    fd = private.open_file(self.path, os.O_RDWR | os.O_CREAT)  # 0600, never through a symlink.
    try:
      if os.fstat(fd).st_mode & 0o777 & ~private.file_mode():  # Made by an older tfdp (0644).
        os.fchmod(fd, private.file_mode())
      have = os.fstat(fd).st_size
      want = max(size, have, mmap.PAGESIZE)
      if allocate and (want > have or size > 0):
        _allocate(fd, self.path, 0, want, want)
      elif want > have:
        os.ftruncate(fd, want)  # Its ranges are allocated before bytes land in them.
      self._holes = not allocate
      self._map = mmap.mmap(fd, want, flags=mmap.MAP_SHARED)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    self._view = np.frombuffer(self._map, np.uint8)
    self._bytes = memoryview(self._map)
    self._places, self._memo = {}, {}

  def fill(self, items: list, start: int = 0, durable: bool = True):
    """Writes `items` (their keys and values) after the first `start` bytes; returns (their records, the bytes used).

    One pass: each chunk is copied, then checksummed from the cache. A string
    this slot already holds at the same place, of the same object (a data
    position saved against one iterator state for many saves), is not
    written again.

    Args:
      items: tfdp.checkpoint.format.planner.Items (or anything with a `key`
        and a `value`: a host tensor or array, or a variant, written as its
        bytes).
      start: the bytes before it are left as they are.
      durable: flush the mapping before returning.
    """
    # A real model saves hundreds of tensors at every save. Each is paid for
    # in Python, holding the GIL the training thread's Python needs, and
    # each object made for it that lives until a collection adds to the
    # full collections of the process's whole heap (hundreds of ms each for
    # a TF process). A host tensor therefore gets no object of its own
    # here, and the records are columns
    # (tfdp.checkpoint.format.manifest.SlotEntries); other values (strings,
    # arrays, variants) go through `source`.
    keys, names, shapes, sizes, other = [], [], [], [], {}
    for i, it in enumerate(items):
      value = it.value
      name = None
      if isinstance(value, _EagerTensor):
        name = _FIXED.get(value._datatype_enum())  # pylint: disable=protected-access
      if name is None:
        if isinstance(value, tf.Tensor):
          value = items_lib.writable(value)  # A variant becomes its bytes.
        src = other[i] = source(it.key, value)
        name, shape, size = src.dtype, tuple(src.shape), src.size
      else:
        shape = value._shape_tuple()  # pylint: disable=protected-access
        size = _ITEMSIZE[name] * math.prod(shape)
      keys.append(it.key)
      names.append(name)
      shapes.append(shape)
      sizes.append(size)
    strings = {i for i, src in other.items() if src.dtype == "string"}
    with self._lock:
      places = _places(keys, sizes, strings, self._places, start)
      used = max((off + room for off, room in places.values()), default=start)
      self._ensure(used)
      if places is not self._places:
        self._memo = {}
      self._places = places
      memo, self._memo = self._memo, {}
      offsets, crcs = [], []
      for i, key in enumerate(keys):
        off, size = places[key][0], sizes[i]
        src = other.get(i)
        if src is None:
          crc = self._write_buffer(_flat(items[i].value._numpy()), off, 0)  # pylint: disable=protected-access
        elif i not in strings:
          crc = self._write(src, off)
        else:
          hit = memo.get(key)
          crc = (hit[3] if hit is not None and hit[0] is src.value and hit[1:3] == (off, size)
                 else self._write(src, off))
          if size > _STRING_ALIGN:
            self._memo[key] = (src.value, off, size, crc)
        offsets.append(off)
        crcs.append(crc)
      if durable:
        self._map.flush()  # msync: a real disk (NVMe) has the bytes before the record names them.
      return (SlotEntries(keys, names, shapes, offsets, sizes, crcs),
              max(map(int.__add__, offsets, sizes), default=start))

  def _write_buffer(self, buf, off, crc):
    """Copies flat buffer `buf` to `off` and extends `crc` over it, chunk by chunk from the cache."""
    n = len(buf)
    if n <= _SMALL:  # Most tensors of a real model: one memoryview copy, one CRC call.
      piece = self._bytes[off:off + n]
      piece[:] = buf
      return checksum.extend(crc, piece)
    dst = self._view
    if not isinstance(buf, np.ndarray):
      buf = np.frombuffer(buf, np.uint8)  # numpy's copy of a chunk lets the GIL go.
    for a in range(0, n, slot_file.CHUNK):
      chunk = buf[a:a + slot_file.CHUNK]
      piece = dst[off + a:off + a + len(chunk)]
      piece[:] = chunk
      crc = checksum.extend(crc, piece)
    return crc

  def _write(self, s, off):
    crc = s.crc
    if s.head:
      self._bytes[off:off + len(s.head)] = s.head
      off += len(s.head)
    for buf in s.buffers:
      crc = self._write_buffer(buf, off, crc)
      off += len(buf)
    return crc

  def receivable(self, size: int):
    """(the slot's first `size` bytes, `allocate(start, end)`), to receive a copy into (its places are forgotten).

    The bytes of a fresh slot are not allocated yet: the receiver allocates
    each range with `allocate` 16 MB ahead of the bytes, which are written
    to the file, not through the mapping
    (tfdp.checkpoint.format.slot_file.receive), so that a fresh tmpfs's
    allocation of 1 GB (about 0.2 s here) is spread over the transfer. A
    full disk still fails in `allocate` (CheckpointError), before any byte
    is written into the range it refused: a write into a hole of a full
    tmpfs would end the process (SIGBUS). A slot already mapped that big is
    allocated already.
    """
    with self._lock:
      self._ensure(size, allocate=False)
      self._holes = True  # Until a fill allocates it all (`_ensure`).
      self._places, self._memo = {}, {}
      fd, path = self._fd, self.path
      return self._view[:size], lambda start, end: _allocate(fd, path, start, end, size)

  def close(self) -> None:
    self._view = None
    if self._bytes is not None:
      self._bytes.release()
      self._bytes = None
    if self._map is not None:
      try:
        self._map.close()
      except BufferError:
        pass  # Arrays still view it: it closes when they are gone.
      self._map = None
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

