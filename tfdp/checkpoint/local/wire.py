"""The side channel's frames and what a header may hold: nothing in this module trusts the wire.

A frame is an 8-byte length, a JSON header (of bounded size and depth),
then byte blobs, read as they arrive and never allocated whole from a
header. `check_header` validates every field of a header (known kind,
integer worker ids in range, integer steps, bounded sizes) before anything
acts on it, and no path is ever made from a header; per-worker tensors are
numbers, bools or strings. On the wire every frame goes through an
authenticated tfdp.checkpoint.local.channel.Channel, which adds its MACs; the
plain framing here is also the format of a kept per-worker state's file.
"""

import json
import re
import socket
import struct
import threading
import time

import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.framework import types_pb2

LENGTH = struct.Struct("<Q")  # A frame's header length.
# Bounds on what a header may ask for.
MAX_HEADER_BYTES = 4 << 20  # A copy's header holds its manifest (every tensor's key).
MAX_HEADER_DEPTH = 8  # Nesting of a header's JSON ([] and {}); the protocol's needs 2.
MAX_BLOBS = 4096
MAX_KEY_CHARS = 4096
MAX_TOKEN_CHARS = 128
MAX_STEP = 2 ** 53
# How far ahead of the steps a worker knows a peer's report may be (StepBound).
AHEAD_GENERATIONS = 4
AHEAD_MIN_STEPS = 1000
_CHUNK = 1 << 20  # A blob's memory grows by what arrived, at most this much ahead.

# Kinds of frames and the fields each may have (besides kind, from, step, sizes).
PER_WORKER, ACK, DONE, COPY, PER_WORKER_COPY = (
    "per_worker", "ack", "done", "copy", "per_worker_copy")
_FIELDS = {
    PER_WORKER: {"keys", "token", "world_size"},  # a neighbour's state after a local save
    ACK: set(),  # kept: the answer to PER_WORKER
    DONE: set(),  # a worker's part of a step is everywhere (to the others)
    COPY: {"manifest"},  # a whole local copy (its record, its slot's bytes), at a restore
    PER_WORKER_COPY: {"keys", "token"},  # a worker's own state, sent back by its neighbour
}
KINDS = tuple(_FIELDS)
_COMMON = {"kind", "from", "step", "sizes"}


class Refused(Exception):
  """A connection or frame that is not of this job, or not well formed: dropped, never acted on.

  Args:
    reason: what is wrong, for the log.
    key: the kind of problem (the log has one line per kind).
  """

  def __init__(self, reason: str, key: str = "frame"):
    super().__init__(reason)
    self.key = key


def recv_exact(sock, n: int, deadline: float | None = None) -> bytearray:
  """Exactly `n` bytes from `sock`; ConnectionError when the peer closes first.

  Args:
    sock: a socket.
    n: the bytes to read.
    deadline: a time.monotonic() by which all must have come (socket.timeout then).
  """
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0:
        raise socket.timeout("the handshake took too long")
      sock.settimeout(left)
    k = sock.recv_into(view[got:])
    if not k:
      raise ConnectionError("peer closed the connection")
    got += k
  return buf


# -- frames --

def frame(header: dict, blobs=()) -> list:
  """A message as buffers, unauthenticated: its header's length, the header (JSON), the blobs.

  The format of a kept per-worker state's file (tfdp.checkpoint.local.replicas);
  on the wire, channel.Channel adds the MACs.
  """
  blobs = [memoryview(b).cast("B") for b in blobs]
  head = json.dumps(dict(header, sizes=[b.nbytes for b in blobs])).encode()
  return [LENGTH.pack(len(head)) + head] + blobs


# A string, or an unterminated one to the end: every match succeeds, so the
# scan is one linear pass (a required closing quote made `"\"\"...` quadratic).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def parse_header(raw: bytes) -> dict:
  """A header's JSON object, refused when it is not one, or nests deeper than MAX_HEADER_DEPTH.

  Raises:
    Refused: naming what is wrong.
  """
  depth = 0
  for m in _BRACKET.finditer(_STRING.sub(b'""', raw)):  # Brackets outside strings.
    depth += 1 if m.group() in b"[{" else -1
    if depth > MAX_HEADER_DEPTH:
      raise Refused(f"a header nested deeper than {MAX_HEADER_DEPTH}", "header")
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise Refused(f"a header that is not JSON ({str(e)[:80]})", "header") from None
  if not isinstance(header, dict):
    raise Refused("a header that is not a JSON object", "header")
  return header


def read_length(sock) -> int | None:
  """A frame's header length (bounded); None when the peer closed between frames."""
  first = sock.recv(1)
  if not first:
    return None
  (n,) = LENGTH.unpack(bytes(first) + bytes(recv_exact(sock, LENGTH.size - 1)))
  if n > MAX_HEADER_BYTES:
    raise Refused(f"a header of {n} bytes (more than {MAX_HEADER_BYTES})", "header")
  return n


def grow_into(recv_into, size: int) -> bytearray:
  """`size` bytes by `recv_into`, the buffer growing with what arrived (an empty promise allocates nothing)."""
  buf = bytearray()
  while len(buf) < size:
    at = len(buf)
    buf.extend(bytes(min(_CHUNK, size - at)))
    view = memoryview(buf)
    try:
      while at < len(buf):
        k = recv_into(view[at:])
        if not k:
          raise ConnectionError("peer closed the connection")
        at += k
    finally:
      view.release()
  return buf


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def check_header(header: dict, sender: int, num_workers: int) -> None:
  """Checks every field of a frame's header from authenticated worker `sender`.

  Raises:
    Refused: naming the first field that is wrong.
  """
  kind = header.get("kind")
  if not isinstance(kind, str) or kind not in _FIELDS:
    raise Refused(f"unknown kind {str(kind)[:40]!r}")
  extra = set(header) - _COMMON - _FIELDS[kind]
  if extra:
    raise Refused(f"{kind}: unknown fields {sorted(str(k)[:40] for k in extra)}")
  source = header.get("from")
  if not _is_int(source) or not 0 <= source < num_workers or source != sender:
    raise Refused(f"{kind}: from={str(source)[:40]!r}, but the connection is worker {sender}'s")
  step = header.get("step")
  if not _is_int(step) or not 0 <= step < MAX_STEP:
    raise Refused(f"{kind}: step={str(step)[:40]!r} is not an integer >= 0")
  sizes = header.get("sizes")
  if (not isinstance(sizes, list) or len(sizes) > MAX_BLOBS
      or not all(_is_int(s) and s >= 0 for s in sizes)):
    raise Refused(f"{kind}: sizes are not a list of at most {MAX_BLOBS} integers >= 0")
  if kind in (ACK, DONE) and sizes:
    raise Refused(f"{kind}: carries data")
  if kind in (PER_WORKER, PER_WORKER_COPY):
    keys = header.get("keys")
    if (not isinstance(keys, list) or len(keys) != len(sizes)
        or not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys)
        or len(set(keys)) != len(keys)):
      raise Refused(f"{kind}: keys are not one distinct name per blob")
    token = header.get("token")
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
      raise Refused(f"{kind}: token is not a short string")
  if kind == PER_WORKER and header.get("world_size") != num_workers:
    raise Refused(f"{kind}: world_size={str(header.get('world_size'))[:40]!r}, "
                  f"this job has {num_workers}")
  if kind == COPY:
    if not isinstance(header.get("manifest"), str):
      raise Refused(f"{kind}: no manifest")
    if len(sizes) != 1:
      raise Refused(f"{kind}: {len(sizes)} blobs, a copy is one slot's bytes")


class StepBound:
  """How far ahead a peer's report (PER_WORKER, DONE) may be of the steps this worker knows of the job.

  A few generations (a busy writer skips saves) past the newest of this
  worker's own reports and that sender's, never fewer than AHEAD_MIN_STEPS:
  a state at step 10^9 or a DONE at 2^53-1 would never be pruned, or make
  every newer step dead.

  Args:
    own_step: `fn()` -> the newest step this worker holds, or None: the
      bound before this worker has reported a step itself.
  """

  def __init__(self, own_step=None):
    self._own_step = own_step
    self._lock = threading.Lock()
    self._known = {}  # worker -> the newest step of its reports
    self._sent = []  # The last two steps this worker reported itself.

  def sent(self, step: int) -> None:
    """This worker reports `step` itself."""
    with self._lock:
      if not self._sent or step > self._sent[-1]:
        self._sent = (self._sent + [step])[-2:]

  def known(self, sender: int, step: int) -> None:
    """Worker `sender`'s report of `step` was accepted."""
    with self._lock:
      self._known[sender] = max(step, self._known.get(sender, step))

  def check(self, kind: str, sender: int, step: int) -> None:
    """Refuses a report of `step` far ahead of the newest this worker knows of the job.

    Raises:
      Refused: naming the step.
    """
    with self._lock:
      known = [s for s in (self._known.get(sender), self._sent[-1] if self._sent else None)
               if s is not None]
      gap = self._sent[1] - self._sent[0] if len(self._sent) == 2 else 1
    if not known and self._own_step is not None and self._own_step() is not None:
      known = [self._own_step()]
    if not known:
      return  # The first report of a job: nothing to bound it by yet.
    if step > max(known) + max(AHEAD_GENERATIONS * gap, AHEAD_MIN_STEPS):
      raise Refused(f"a {kind} of step {step}, far ahead of step {max(known)}, the newest this "
                    "worker knows of the job", "step")


# -- tensors --

def tensors_to_wire(tensors: dict) -> tuple[dict, list]:
  """{key: tensor} as (a JSON-able description, the blobs): each tensor's `serialize_tensor` bytes."""
  keys = sorted(tensors)
  return {"keys": keys}, [tf.io.serialize_tensor(tensors[k]).numpy() for k in keys]


def tensors_from_wire(description: dict, blobs) -> dict:
  """The inverse of `tensors_to_wire` (dtypes travel inside the serialized tensors).

  Raises:
    ValueError: a blob that is not a serialized tensor.
  """
  out = {}
  for key, blob, dtype in zip(description["keys"], blobs, check_dtypes(description["keys"], blobs)):
    try:
      out[key] = tf.io.parse_tensor(bytes(blob), tf.dtypes.as_dtype(dtype))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"per-worker tensor {key!r} does not parse: {e}") from e
  return out


def check_dtypes(keys, blobs) -> list[int]:
  """The dtype of each serialized tensor in `blobs`: a number, a bool or a string, never a variant or a resource.

  Raises:
    ValueError: a blob that is not a serialized tensor, or of another dtype.
  """
  dtypes = []
  for key, blob in zip(keys, blobs):
    proto = tensor_pb2.TensorProto()
    try:
      proto.ParseFromString(bytes(blob))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"per-worker tensor {key!r} does not parse: {e}") from e
    if proto.dtype not in _WIRE_DTYPES:
      name = (types_pb2.DataType.Name(proto.dtype) if proto.dtype in types_pb2.DataType.values()
              else proto.dtype)
      raise ValueError(f"per-worker tensor {key!r} has dtype {name}, not a number, a bool or "
                       "a string")
    dtypes.append(proto.dtype)
  return dtypes


# What a per-worker tensor from the wire may be: numbers, bools, strings.
_WIRE_DTYPES = frozenset(
    tf.as_dtype(d).as_datatype_enum for d in (
        "bool", "string", "half", "bfloat16", "float32", "float64", "int8", "int16", "int32",
        "int64", "uint8", "uint16", "uint32", "uint64", "complex64", "complex128"))
