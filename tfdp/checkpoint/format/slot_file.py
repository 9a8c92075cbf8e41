"""The local tier's slot-file format: each tensor at a fixed offset with its CRC32C, checked as it is read or received.

A slot file holds a copy's tensors, each at the offset its record
(tfdp.checkpoint.format.manifest.SlotTensor, not imported here: the
manifest's verification imports this module) names. Bytes are laid out as
TensorFlow's tensor bundles lay them out (strings: varint lengths, their
masked CRC32C, the bytes), so a TF index can describe a slot
(tfdp.checkpoint.local.bundle). The writer is tfdp.checkpoint.local.slots;
this module checks records, reads, and receives. `times`, where a function
takes it, is an object with `add(phase, seconds)`
(tfdp.checkpoint.local.phases.PhaseTimes) its phases' seconds are added to.
"""

import ctypes
import mmap
import os
import struct
import threading
import time

import numpy as np
import tensorflow as tf

from tfdp import errors
from tfdp.checkpoint.format import checksum
from tfdp.checkpoint.format import private

CHUNK = 2 << 20  # Copied, then checksummed while in the cache (L2-sized).
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


def length_bytes(n: int) -> bytes:
  """A string's length as TF's bundle checksums it: 4 bytes little-endian, 8 when it needs them."""
  return struct.pack("<I" if n <= 0xFFFFFFFF else "<Q", n)


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
    crc = checksum.extend(crc, length_bytes(n))
  check = bytes(data[at:at + 4])
  if len(check) != 4 or struct.unpack("<I", check)[0] != mask(crc):
    raise ValueError("the string lengths do not match their CRC32C")
  crc, at = checksum.extend(crc, check), at + 4
  out = []
  for n in lengths:
    if at + n > len(data):
      raise ValueError("strings run past the tensor")
    crc = checksum.extend(crc, data[at:at + n])
    out.append(bytes(data[at:at + n]))
    at += n
  if at != len(data):
    raise ValueError("bytes after the strings")
  return out, crc


def crc_of(entry, data) -> int:
  """The CRC32C of `entry`'s bytes `data` as its record states it (raises ValueError for malformed strings)."""
  if entry.dtype != "string":
    return checksum.value(data)
  count = int(np.prod(entry.shape, dtype=np.int64))
  return _strings(data, count)[1] if count else 0


def value_of(entry, data):
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


def read(path: str, entries: list, size: int, checked: bool = False, times=None) -> dict:
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
    times: where the seconds of `map`, `check` and `views` are added (None: not timed).

  Raises:
    CorruptCheckpointError: naming the first tensor whose bytes do not match.
  """
  start = time.perf_counter()
  try:
    mapped = open_read(path, size)
  except (OSError, ValueError) as e:
    raise errors.CorruptCheckpointError(f"{path}: cannot map {size} bytes: {e}") from e
  view = np.frombuffer(mapped, np.uint8) if size else np.zeros(0, np.uint8)
  mapped_at = time.perf_counter()
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
  checked_at = time.perf_counter()
  out = {e.key: value_of(e, view[e.offset:e.offset + e.size]) for e in entries}
  if times is not None:
    times.add("map", mapped_at - start)
    times.add("check", checked_at - mapped_at)
    times.add("views", time.perf_counter() - checked_at)
  return out


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without touching their bytes.
_libc = ctypes.CDLL(None, use_errno=True)  # Its calls release the GIL.


class _Prefault:
  """Makes a slot's pages ready on a thread of its own, ahead of the bytes being received into them.

  A fresh slot is a hole: each range is allocated (`allocate`, where the
  caller passes one) before the receiving thread may write there (`wait`),
  and its pages faulted in (MADV_POPULATE_WRITE: as a write would, without
  writing a byte), so that the receiving thread's `recv_into` only copies.
  Both run beside the transfer instead of before it or inside it. Faulting
  writes nothing, so it may run anywhere beside the receiving thread; where
  the kernel lacks it, only the allocation runs here.
  """

  def __init__(self, dst: np.ndarray, allocate):
    self._addr, self._size, self._allocate = dst.ctypes.data, dst.nbytes, allocate
    self._cond = threading.Condition()
    self.ready = 0 if allocate is not None else self._size  # Bytes the receiver may write.
    self.error, self.stop = None, False

  def run(self) -> None:
    populate, at = self._addr % mmap.PAGESIZE == 0, 0
    try:
      while at < self._size and not self.stop:
        n = min(8 * CHUNK, self._size - at)
        if self._allocate is not None:
          self._allocate(at, at + n)
          with self._cond:  # The receiver waits for the allocation only, not for the faults.
            self.ready = at + n
            self._cond.notify_all()
        if populate and _libc.madvise(ctypes.c_void_p(self._addr + at), ctypes.c_size_t(n),
                                      _MADV_POPULATE_WRITE) != 0:
          populate = False
          if self._allocate is None:
            return
        at += n
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self.error = e
        self._cond.notify_all()

  def wait(self, end: int) -> None:
    """Until bytes [0, end) may be written (raises what the allocation raised)."""
    if self.ready >= end:
      return
    with self._cond:
      while self.ready < end and self.error is None:
        self._cond.wait()
    if self.error is not None:
      raise self.error


def receive(recv_into, dst: np.ndarray, entries: list, times=None, digest=None,
            allocate=None) -> None:
  """Fills `dst` from a socket's `recv_into`, checking each tensor's CRC32C as its bytes land.

  One pass over the bytes: this thread only receives; a third thread
  (`_Prefault`) allocates and faults in the pages ahead of it; a checking
  thread follows it over what has landed, a piece of at most CHUNK bytes
  at a time while the piece is in the cache, extending each tensor's CRC32C
  (and `digest`), so that the check of piece k runs while piece k+1
  arrives (both release the GIL). Fixed-size tensors are checked as they
  complete, strings once all is here. The first mismatch stops the
  receiving. `times` gets the seconds waited for bytes (`recv`) and for
  their room to be allocated (`allocate`), the checking thread's own
  seconds (`land_check`, overlapped with `recv`) and those after the last
  byte until all is checked (`land_tail`).

  Args:
    recv_into: a socket's `recv_into` (the bytes as they come).
    dst: where they land (a slot's first bytes).
    entries: the copy's record's tensors (checked by `check_entries`).
    times: a PhaseTimes, or None.
    digest: `fn(bytes)`, fed every byte of `dst` in order on the checking
      thread (the frame's MAC: tfdp.checkpoint.local.channel.Channel), or None.
    allocate: `fn(start, end)` that allocates those bytes of `dst`'s file,
      called ahead of the bytes on a third thread (`dst` is a hole until
      then; tfdp.checkpoint.local.slots.Slot.receivable), or None
      (allocated already).

  Raises:
    ConnectionError: the sender stopped before `dst` was full.
    ValueError: naming the first tensor whose bytes do not match.
  """
  check = _Landing(dst, entries, digest)
  thread = threading.Thread(target=check.run, name="tfdp-land-check", daemon=True)
  thread.start()
  prefault = _Prefault(dst, allocate)
  threading.Thread(target=prefault.run, name="tfdp-land-prefault", daemon=True).start()
  pos, waited, allocating = 0, 0.0, 0.0
  try:
    while pos < len(dst) and check.error is None:
      t = time.perf_counter()
      prefault.wait(min(pos + CHUNK, len(dst)))
      allocating += time.perf_counter() - t
      t = time.perf_counter()
      k = recv_into(dst[pos:pos + CHUNK])
      waited += time.perf_counter() - t
      if not k:
        raise ConnectionError("the sender stopped in the middle of the copy")
      pos += k
      check.landed(pos)
  except BaseException:
    prefault.stop = True
    check.landed(pos, final=True, abort=True)  # Nothing of a cut copy is kept: not checked.
    thread.join()
    raise
  prefault.stop = True
  last = time.perf_counter()
  check.landed(pos, final=True)
  thread.join()
  if times is not None:
    times.add("allocate", allocating)  # Waited for, beside the transfer.
    times.add("recv", waited)
    times.add("land_check", check.busy)
    times.add("land_tail", time.perf_counter() - last)
  if check.error is not None:
    raise ValueError(check.error)
  for e in entries:
    if e.dtype == "string" and crc_of(e, dst[e.offset:e.offset + e.size]) != e.crc32c:
      raise ValueError(f"tensor {e.key!r} does not match its CRC32C")


class _Landing:
  """The checking thread of `receive`: follows the bytes landed, CHUNK by CHUNK, as they come."""

  def __init__(self, dst, entries, digest):
    self._dst, self._digest = dst, digest
    self._numeric = sorted((e for e in entries if e.dtype != "string"), key=lambda e: e.offset)
    self._cond = threading.Condition()
    self._landed, self._final, self._abort = 0, False, False
    self.error, self.busy = None, 0.0

  def landed(self, pos: int, final: bool = False, abort: bool = False) -> None:
    """The first `pos` bytes are in `dst` (`final`: no more will come; `abort`: stop checking)."""
    with self._cond:
      self._landed, self._final, self._abort = pos, final, abort
      self._cond.notify()

  def run(self) -> None:
    at, i, crc = 0, 0, 0
    numeric, dst = self._numeric, self._dst
    while True:
      with self._cond:
        while self._landed == at and not self._final:
          self._cond.wait()
        upto, final = self._landed, self._final
      start = time.perf_counter()
      while at < upto and not self._abort:
        end = min(upto, at + CHUNK)
        if self._digest is not None:
          self._digest(dst[at:end])
        while i < len(numeric) and numeric[i].offset < end:
          e = numeric[i]
          a, b = max(at, e.offset), min(end, e.offset + e.size)
          if b > a:
            crc = checksum.extend(crc, dst[a:b])
          if e.offset + e.size > end:
            break
          if crc != e.crc32c:
            self.error = f"tensor {e.key!r} does not match its CRC32C"
            return
          i, crc = i + 1, 0
        at = end
      self.busy += time.perf_counter() - start
      if self._abort:
        return
      if final and at == upto:
        if at == len(dst):
          for e in numeric[i:]:  # Empty ones at the very end.
            if e.crc32c != 0 or e.size:
              self.error = f"tensor {e.key!r} does not match its CRC32C"
              return
        return
