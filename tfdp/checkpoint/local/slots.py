"""The local tier's slot files: each tensor at a fixed offset, written and checked in one pass with its CRC32C.

A worker has COUNT preallocated slot files (tfdp.checkpoint.local chooses
which one a save fills; the committed newest is never written). A fill
copies each tensor's bytes into the slot in chunks and extends the
tensor's CRC32C over each chunk while it is in the cache (google-crc32c: C,
hardware-accelerated). A read maps the slot, checks every tensor's CRC32C
and hands back arrays that view the mapping. Bytes are laid out as
TensorFlow's tensor bundles lay them out (strings: varint lengths, their
masked CRC32C, the bytes), so a TF index can describe a slot
(tfdp.checkpoint.local.bundle).
"""

import collections
import dataclasses
import mmap
import os
import struct
import threading
import time

import google_crc32c
import numpy as np
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint import faults
from tfdp.checkpoint.format import private
from tfdp.checkpoint.local import phases as restore_phases
from tfdp.checkpoint.format.manifest import SlotTensor

COUNT = 2
# A fault point of the tests: half of a slot's tensors are written.
FILL_FAULT = "during_fill"
_CHUNK = 2 << 20  # Copied, then checksummed while in the cache (L2-sized).
_ALIGN = 64  # Each tensor's offset: what TF needs to use the bytes in place.
_STRING_ALIGN = 4096
_MAX_ENTRIES = 1 << 20
_MAX_KEY_CHARS = 4096
_MAX_DIMS = 32
# The dtypes a record may name (from disk or from a peer): TF's fixed-size ones, and strings.
DTYPES = {d.name: d for d in (
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64,
    tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.bool, tf.complex64, tf.complex128,
    tf.string)}


def mask(crc: int) -> int:
  """A CRC32C as TF's files store it (masked: a CRC of data holding CRCs stays strong)."""
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def varint(n: int) -> bytes:
  """`n` as a protobuf/LevelDB varint."""
  out = bytearray()
  while n >= 0x80:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _length_bytes(n: int) -> bytes:
  """A string's length as TF's bundle checksums it: 4 bytes little-endian, 8 when it needs them."""
  return struct.pack("<I" if n <= 0xFFFFFFFF else "<Q", n)


def _string_head(values) -> tuple[bytes, int]:
  """TF's bundle layout of strings: (varint lengths + their masked CRC32C, the CRC so far)."""
  crc, lengths = 0, []
  for v in values:
    n = len(v)
    lengths.append(varint(n))
    crc = google_crc32c.extend(crc, _length_bytes(n))
  check = struct.pack("<I", mask(crc))
  return b"".join(lengths) + check, google_crc32c.extend(crc, check)


@dataclasses.dataclass
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


# String tensors made into bytes lately, by identity: a data position saved
# against one iterator state for many saves is the same tensor each time
# (tfdp.checkpoint.format.items.writable), made into bytes once.
_strings_of = collections.OrderedDict()
_strings_lock = threading.Lock()


def _string_source(key, value, shape):
  with _strings_lock:
    hit = _strings_of.get(id(value))
  if hit is not None and hit[0] is value:
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


def source(key: str, value) -> _Source:
  """The bytes of `value` (a host tensor or array; strings as TF's bundles hold them), without a copy.

  On a device (GPU) `_numpy()` is the device-to-host copy.
  """
  dtype = tf.as_dtype(value.dtype)
  shape = [int(d) for d in value.shape]
  if dtype == tf.string:
    return _string_source(key, value, shape)
  if dtype.name not in DTYPES:
    raise errors.CheckpointError(f"{key}: a {dtype.name} tensor cannot be saved in the local tier.")
  arr = value._numpy() if isinstance(value, tf.Tensor) else np.asarray(value)  # pylint: disable=protected-access
  flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
  return _Source(key, dtype.name, shape, flat.nbytes, [flat], value=value)


def _align(n: int, to: int) -> int:
  return -(-n // to) * to


def _places(sources, previous, start):
  """{key: (offset, room)}: the previous places when every tensor still fits (fixed offsets), else new ones."""
  if previous and set(previous) == {s.key for s in sources} and all(
      s.size <= previous[s.key][1] for s in sources) and all(
      off >= start for off, _ in previous.values()):
    return previous
  places, at = {}, _align(start, _ALIGN)
  # Fixed-size tensors first: a string that grows moves only strings.
  for s in sorted(sources, key=lambda s: (s.dtype == "string", s.key)):
    room = (_align(s.size + s.size // 16, _STRING_ALIGN) if s.dtype == "string"
            else _align(s.size, _ALIGN))
    places[s.key] = (at, room)
    at += room
  return places


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
    self._places = {}
    self._memo = {}  # key -> (value, offset, size, crc) of strings written in this slot.
    self._lock = threading.Lock()

  @property
  def capacity(self) -> int:
    return 0 if self._map is None else len(self._map)

  def _ensure(self, size: int) -> None:
    """Maps the file with at least `size` bytes, allocated (a full tmpfs fails here, not in a write)."""
    if self._map is not None and len(self._map) >= size and os.path.exists(self.path):
      return
    self.close()
    fd = private.open_file(self.path, os.O_RDWR | os.O_CREAT)  # 0600, never through a symlink.
    try:
      if os.fstat(fd).st_mode & 0o777 & ~private.file_mode():  # Made by an older tfdp (0644).
        os.fchmod(fd, private.file_mode())
      have = os.fstat(fd).st_size
      want = max(size, have, mmap.PAGESIZE)
      if want > have or size > 0:
        try:
          os.posix_fallocate(fd, 0, want)
        except OSError as e:
          if e.errno not in (95,):  # EOPNOTSUPP: a file system without it.
            raise errors.CheckpointError(
                f"{self.path}: cannot allocate {want / 1e6:.1f} MB for a local checkpoint slot "
                f"({e}). Free space there or pass another local_checkpoint_dir.") from e
          os.ftruncate(fd, want)
      self._map = mmap.mmap(fd, want, flags=mmap.MAP_SHARED)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    self._view = np.frombuffer(self._map, np.uint8)
    self._places, self._memo = {}, {}

  def fill(self, sources: list, worker: int, start: int = 0, durable: bool = True):
    """Writes `sources` after the first `start` bytes; returns (their records, the bytes used).

    One pass: each chunk is copied, then checksummed from the cache. A string
    this slot already holds at the same place, of the same object (a data
    position saved against one iterator state for many saves), is not
    written again.
    """
    with self._lock:
      places = _places(sources, self._places, start)
      used = max((off + room for off, room in places.values()), default=start)
      self._ensure(used)
      if places is not self._places:
        self._memo = {}
      self._places = places
      memo, self._memo = self._memo, {}
      out = []
      for i, s in enumerate(sources):
        if i == len(sources) // 2:
          faults.reached(FILL_FAULT, worker)
        off = places[s.key][0]
        hit = memo.get(s.key)
        if hit is not None and hit[0] is s.value and hit[1:3] == (off, s.size):
          crc = hit[3]
        else:
          crc = self._write(s, off)
        if s.dtype == "string" and s.size > _STRING_ALIGN:
          self._memo[s.key] = (s.value, off, s.size, crc)
        out.append(SlotTensor(s.key, s.dtype, s.shape, off, s.size, crc))
      if durable:
        self._map.flush()  # msync: a real disk (NVMe) has the bytes before the record names them.
      return out, max((e.offset + e.size for e in out), default=start)

  def _write(self, s, off):
    dst, crc = self._view, s.crc
    if s.head:
      dst[off:off + len(s.head)] = np.frombuffer(s.head, np.uint8)
      off += len(s.head)
    for buf in s.buffers:
      for a in range(0, len(buf), _CHUNK):
        chunk = buf[a:a + _CHUNK]
        dst[off + a:off + a + len(chunk)] = chunk
        crc = google_crc32c.extend(crc, dst[off + a:off + a + len(chunk)])
      off += len(buf)
    return crc

  def writable(self, size: int) -> np.ndarray:
    """The slot's first `size` bytes, to receive a copy into (its places are forgotten)."""
    with self._lock:
      self._ensure(size)
      self._places, self._memo = {}, {}
      return self._view[:size]

  def close(self) -> None:
    self._view = None
    if self._map is not None:
      try:
        self._map.close()
      except BufferError:
        pass  # Arrays still view it: it closes when they are gone.
      self._map = None
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def check_entries(entries, size: int) -> None:
  """Checks that a record's tensors are well formed and lie inside `size` bytes, without overlap.

  A record comes from disk or from a peer: nothing in it is trusted.

  Raises:
    ValueError: naming what is wrong.
  """
  if not isinstance(entries, list) or len(entries) > _MAX_ENTRIES:
    raise ValueError("no list of slot tensors")
  end, keys = 0, set()
  for e in sorted(entries, key=lambda e: e.offset if isinstance(e.offset, int) else -1):
    ints = (e.offset, e.size, e.crc32c)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
      raise ValueError(f"a slot tensor with non-integer fields: {str(e.key)[:80]!r}")
    if not (isinstance(e.key, str) and 0 < len(e.key) <= _MAX_KEY_CHARS) or e.key in keys:
      raise ValueError(f"a slot tensor key that is not a distinct name: {str(e.key)[:80]!r}")
    keys.add(e.key)
    if e.dtype not in DTYPES:
      raise ValueError(f"{e.key}: unknown dtype {str(e.dtype)[:40]!r}")
    if not (isinstance(e.shape, list) and len(e.shape) <= _MAX_DIMS and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 62 for d in e.shape)):
      raise ValueError(f"{e.key}: a shape that is not a list of sizes")
    if not (e.offset >= end and e.size >= 0 and e.offset + e.size <= size
            and 0 <= e.crc32c < 2 ** 32):
      raise ValueError(f"{e.key}: bytes {e.offset}+{e.size} overlap or lie outside {size}")
    if e.dtype != "string" and e.size != int(np.prod(e.shape, dtype=np.int64)) * DTYPES[
        e.dtype].size:
      raise ValueError(f"{e.key}: {e.size} bytes for a {e.dtype} tensor of shape {e.shape}")
    end = e.offset + e.size


def _strings(data, count):
  """(the strings, TF's CRC32C of them) of a string tensor's bytes, checking its lengths' own CRC."""
  crc, lengths, at = 0, [], 0
  for _ in range(count):
    n, shift = 0, 0
    while True:
      if at >= len(data) or shift > 63:
        raise ValueError("string lengths run past the tensor")
      b = int(data[at])
      at += 1
      n |= (b & 0x7F) << shift
      shift += 7
      if b < 0x80:
        break
    lengths.append(n)
    crc = google_crc32c.extend(crc, _length_bytes(n))
  check = bytes(data[at:at + 4])
  if len(check) != 4 or struct.unpack("<I", check)[0] != mask(crc):
    raise ValueError("the string lengths do not match their CRC32C")
  crc, at = google_crc32c.extend(crc, check), at + 4
  out = []
  for n in lengths:
    if at + n > len(data):
      raise ValueError("strings run past the tensor")
    crc = google_crc32c.extend(crc, data[at:at + n])
    out.append(bytes(data[at:at + n]))
    at += n
  if at != len(data):
    raise ValueError("bytes after the strings")
  return out, crc


def crc_of(entry: SlotTensor, data) -> int:
  """The CRC32C of `entry`'s bytes `data` as its record states it (raises ValueError for malformed strings)."""
  if entry.dtype != "string":
    return google_crc32c.value(data)
  count = int(np.prod(entry.shape, dtype=np.int64))
  return _strings(data, count)[1] if count else 0


def value_of(entry: SlotTensor, data):
  """The array (a view of `data`, no copy) or strings (bytes, or an object array) of `entry`."""
  if entry.dtype == "string":
    count = int(np.prod(entry.shape, dtype=np.int64))
    strings = _strings(data, count)[0] if count else []
    if not entry.shape:
      return strings[0]
    return np.array(strings, dtype=object).reshape(entry.shape)
  dtype = DTYPES[entry.dtype].as_numpy_dtype
  return np.frombuffer(data, dtype).reshape(entry.shape)


def open_read(path: str, size: int):
  """A read-only mapping of the first `size` bytes of slot `path`, faulted in at once."""
  with os.fdopen(private.open_file(path, os.O_RDONLY), "rb") as f:
    if size == 0:
      return memoryview(b"")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)


def read(path: str, entries: list, size: int, checked: bool = False) -> dict:
  """{key: value} of a slot's tensors, each checked against its CRC32C first (one pass).

  Numeric values are read-only arrays that view the mapping (no copy).

  Args:
    path: the slot file.
    entries: its record's tensors (checked by `check_entries`).
    size: the bytes of the slot they use.
    checked: this process checked every tensor's bytes in the slot since
      they were last written (a copy `receive` landed, then committed): the
      fixed-size tensors are not checked again (strings are, as they are
      parsed).

  Raises:
    CorruptCheckpointError: naming the first tensor whose bytes do not match.
  """
  try:
    with restore_phases.timed("map"):
      mapped = open_read(path, size)
  except (OSError, ValueError) as e:
    raise errors.CorruptCheckpointError(f"{path}: cannot map {size} bytes: {e}") from e
  view = np.frombuffer(mapped, np.uint8) if size else np.zeros(0, np.uint8)
  start = time.perf_counter()
  for e in entries:
    if checked and e.dtype != "string":
      continue
    data = view[e.offset:e.offset + e.size]
    try:
      ok = crc_of(e, data) == e.crc32c
    except ValueError:
      ok = False
    if not ok:
      raise errors.CorruptCheckpointError(
          f"{path}: tensor {e.key!r} does not match its CRC32C (bytes {e.offset}-"
          f"{e.offset + e.size} of the slot are corrupt)")
  restore_phases.add("check", time.perf_counter() - start)
  with restore_phases.timed("views"):
    return {e.key: value_of(e, view[e.offset:e.offset + e.size]) for e in entries}


def receive(recv_into, dst: np.ndarray, entries: list) -> None:
  """Fills `dst` from a socket's `recv_into`, checking each tensor's CRC32C as its bytes land.

  Fixed-size tensors are checked chunk by chunk, strings once they are whole.

  Raises:
    ConnectionError: the sender stopped before `dst` was full.
    ValueError: naming the first tensor whose bytes do not match.
  """
  numeric = sorted((e for e in entries if e.dtype != "string"), key=lambda e: e.offset)
  crcs, i, pos, waited = {}, 0, 0, 0.0
  start = time.perf_counter()
  while pos < len(dst):
    t = time.perf_counter()
    k = recv_into(dst[pos:pos + _CHUNK])
    waited += time.perf_counter() - t
    if not k:
      raise ConnectionError("the sender stopped in the middle of the copy")
    end = pos + k
    while i < len(numeric) and numeric[i].offset < end:
      e = numeric[i]
      a, b = max(pos, e.offset), min(end, e.offset + e.size)
      if b > a:
        crcs[e.key] = google_crc32c.extend(crcs.get(e.key, 0), dst[a:b])
      if e.offset + e.size > end:
        break
      if crcs.get(e.key, 0) != e.crc32c:
        raise ValueError(f"tensor {e.key!r} does not match its CRC32C")
      i += 1
    pos = end
  for e in numeric[i:]:  # Empty ones at the very end.
    if e.crc32c != 0 or e.size:
      raise ValueError(f"tensor {e.key!r} does not match its CRC32C")
  for e in entries:
    if e.dtype == "string" and crc_of(e, dst[e.offset:e.offset + e.size]) != e.crc32c:
      raise ValueError(f"tensor {e.key!r} does not match its CRC32C")
  restore_phases.add("recv", waited)
  restore_phases.add("land_check", time.perf_counter() - start - waited)
