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

import collections
import collections.abc
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
  if (not isinstance(entries, collections.abc.Sequence) or isinstance(entries, (str, bytes))
      or len(entries) > _MAX_ENTRIES):
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
    if not (isinstance(e.shape, (list, tuple)) and len(e.shape) <= _MAX_DIMS and all(
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


_PIECES = 8  # Buffers of CHUNK bytes in flight between `receive`'s threads.


def receive(recv_into, dst: np.ndarray, entries: list, path: str, times=None, digest=None,
            allocate=None) -> None:
  """Fills `dst` from a socket's `recv_into`, checking each tensor's CRC32C as its bytes land.

  One pass, three threads, a few buffers of CHUNK bytes that stay in the
  cache: this one allocates the slot's next range ahead of the bytes
  (`allocate`) and receives into a free buffer; a checking thread extends
  each tensor's CRC32C (and `digest`) over each buffer in order; a storing
  thread then writes it to the slot's file `path` (the page cache takes the
  bytes: no page of a mapping faulted in, no fresh tmpfs page zeroed
  first) and frees the buffer. Piece k is checked
  and stored while piece k+1 arrives (each call releases the GIL). Strings
  are checked once all is here. The first mismatch stops the receiving.
  `times` gets the seconds waited for bytes (`recv`), for a free buffer
  (`land_behind`: the other two behind) and allocating (`allocate`), the
  checking thread's (`land_check`) and the storing thread's (`land_write`),
  and those from the last byte until all is checked and stored (`land_tail`).

  Args:
    recv_into: a socket's `recv_into` (the bytes as they come).
    dst: the slot's first bytes, mapped (its strings are checked there once all is in).
    entries: the copy's record's tensors (checked by `check_entries`).
    path: the slot's file, which `dst` maps: where the bytes are written.
    times: a PhaseTimes, or None.
    digest: `fn(bytes)`, fed every byte of `dst` in order on the checking
      thread (the frame's MAC: tfdp.checkpoint.local.channel.Channel), or None.
    allocate: `fn(start, end)` that allocates those bytes of `dst`'s file
      before a byte is stored there (`dst` is a hole until then: a full disk
      is its error, never a write into a hole, SIGBUS through a mapping;
      tfdp.checkpoint.local.slots.Slot.receivable), or None.

  Raises:
    ConnectionError: the sender stopped before `dst` was full.
    ValueError: naming the first tensor whose bytes do not match.
    What `allocate` or a write raised (a full disk).
  """
  fd = private.open_file(path, os.O_WRONLY)
  checks = _Checks(entries, digest)
  pipe = _Pipe(len(dst), (checks, lambda at, piece: _store(fd, at, piece)))
  threads = [threading.Thread(target=pipe.run, args=(k,), name=name, daemon=True)
             for k, name in enumerate(("tfdp-land-check", "tfdp-land-store"))]
  for thread in threads:
    thread.start()
  pos, room = 0, 0 if allocate is not None else len(dst)
  waited = behind = allocating = 0.0
  last = None
  try:
    while pos < len(dst):
      t = time.perf_counter()
      buf = pipe.buffer()
      behind += time.perf_counter() - t
      if buf is None:  # A stage stopped: its error is raised below.
        break
      n, want = 0, min(len(buf), len(dst) - pos)
      t = time.perf_counter()
      if pos + want > room:  # 16 MB at a time, before any of its bytes is stored.
        start, room = room, min(len(dst), room + 8 * CHUNK)
        allocate(start, room)
      allocating += time.perf_counter() - t
      t = time.perf_counter()
      while n < want:
        k = recv_into(buf[n:want])
        if not k:
          raise ConnectionError("the sender stopped in the middle of the copy")
        n += k
      waited += time.perf_counter() - t
      pipe.put(0, (pos, buf, n))
      pos += n
    last = time.perf_counter()
  finally:
    pipe.end(0, abort=last is None)  # Nothing of a cut copy is kept: not checked.
    for thread in threads:
      thread.join()
    os.close(fd)
  if times is not None:
    for phase, seconds in (("recv", waited), ("land_behind", behind), ("allocate", allocating),
                           ("land_check", pipe.busy[0]), ("land_write", pipe.busy[1]),
                           ("land_tail", time.perf_counter() - last)):
      times.add(phase, seconds)
  if pipe.error is not None:
    raise pipe.error
  checks.finish()
  for e in entries:
    if e.dtype == "string" and crc_of(e, dst[e.offset:e.offset + e.size]) != e.crc32c:
      raise ValueError(f"tensor {e.key!r} does not match its CRC32C")


def _store(fd: int, at: int, piece) -> None:
  """Writes a checked piece at byte `at` of the slot's file."""
  while len(piece):  # os.pwrite may write a part.
    n = os.pwrite(fd, piece, at)
    piece, at = piece[n:], at + n


class _Pipe:
  """`receive`'s pieces between its threads: free buffers, then received (to check), then checked (to store).

  Each stage's thread takes its pieces in order; the first error stops them all.
  """

  def __init__(self, size: int, stages):
    self._cond = threading.Condition()
    self._free = [np.empty(min(CHUNK, size), np.uint8) for _ in range(_PIECES)]
    self._stages = stages  # fn(at, piece) of each stage, in order.
    self._queues = [collections.deque() for _ in stages]
    self._ended = [False] * len(stages)  # Nothing more will come to that stage.
    self.busy, self.error, self._abort = [0.0] * len(stages), None, False

  def buffer(self):
    """A free buffer (waits for one); None once a stage failed."""
    with self._cond:
      while not self._free and self.error is None:
        self._cond.wait()
      return self._free.pop() if self.error is None else None

  def put(self, k: int, piece) -> None:
    """Hands `piece` (at, buffer, bytes) to stage k (past the last: its buffer is free again)."""
    with self._cond:
      if k < len(self._queues):
        self._queues[k].append(piece)
      else:
        self._free.append(piece[1])
      self._cond.notify_all()

  def end(self, k: int, abort: bool = False) -> None:
    """Nothing more comes to stage k (`abort`: every stage stops at once)."""
    with self._cond:
      if k < len(self._ended):
        self._ended[k] = True
      self._abort = self._abort or abort
      self._cond.notify_all()

  def run(self, k: int) -> None:
    """Stage k's thread."""
    try:
      while True:
        with self._cond:
          while not (self._queues[k] or self._ended[k] or self._abort or self.error):
            self._cond.wait()
          if self._abort or self.error is not None or not self._queues[k]:
            break
          at, buf, n = self._queues[k].popleft()
        t = time.perf_counter()
        self._stages[k](at, buf[:n])
        self.busy[k] += time.perf_counter() - t
        self.put(k + 1, (at, buf, n))
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self.error = self.error or e
        self._cond.notify_all()
    finally:
      self.end(k + 1)


class _Checks:
  """Each fixed-size tensor's CRC32C (and `digest`) extended over the slot's bytes, given in order."""

  def __init__(self, entries, digest):
    self._numeric = sorted((e for e in entries if e.dtype != "string"), key=lambda e: e.offset)
    self._digest, self._i, self._crc = digest, 0, 0  # The next tensor, its CRC32C so far.

  def __call__(self, at: int, piece) -> None:
    if self._digest is not None:
      self._digest(piece)
    numeric, end = self._numeric, at + len(piece)
    while self._i < len(numeric) and numeric[self._i].offset < end:
      e = numeric[self._i]
      a, b = max(at, e.offset), min(end, e.offset + e.size)
      if b > a:
        self._crc = checksum.extend(self._crc, piece[a - at:b - at])
      if e.offset + e.size > end:
        break
      if self._crc != e.crc32c:
        raise ValueError(f"tensor {e.key!r} does not match its CRC32C")
      self._i, self._crc = self._i + 1, 0

  def finish(self) -> None:
    """All bytes were given: the tensors left (empty ones at the very end) must be empty."""
    for e in self._numeric[self._i:]:
      if e.crc32c != 0 or e.size:
        raise ValueError(f"tensor {e.key!r} does not match its CRC32C")
