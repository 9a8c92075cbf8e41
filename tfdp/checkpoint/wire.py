"""The side channel's wire: an HMAC handshake on the job's secret, framed messages, and what a header may hold.

Nothing in this module trusts the wire. A connection is authenticated
before any frame is read: the server sends a fresh nonce, the client
answers with its worker index, its own nonce and an HMAC-SHA256 of both
under the job's secret (tfdp.cluster.shared_secret), and the server
proves it knows the secret too (so a worker never sends its state to a
process that took a dead peer's port). A frame is an 8-byte length, a JSON
header and byte blobs; `check_header` validates every field of a header
(known kind, integer worker ids in range, integer steps, bounded sizes)
before anything acts on it, and no path is ever made from a header.
"""

import hashlib
import hmac
import json
import secrets
import struct

import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

MAGIC = b"tfdp-peer-v1"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_INDEX = struct.Struct("<I")
HELLO_BYTES = len(MAGIC) + _NONCE  # server -> client
ANSWER_BYTES = len(MAGIC) + _INDEX.size + _NONCE + _MAC  # client -> server
HANDSHAKE_S = 5.0  # A connection that has not authenticated by then is dropped.

# Bounds on what a header may ask for.
MAX_HEADER_BYTES = 4 << 20  # A copy's header holds its manifest (every tensor's key).
MAX_BLOBS = 4096
MAX_KEY_CHARS = 4096
MAX_TOKEN_CHARS = 128
MAX_STEP = 2 ** 53

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


def _mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes, index: bytes) -> bytes:
  return hmac.new(secret, role + MAGIC + nonce_s + nonce_c + index, hashlib.sha256).digest()


def recv_exact(sock, n: int) -> bytearray:
  """Exactly `n` bytes from `sock`; ConnectionError when the peer closes first."""
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:])
    if not k:
      raise ConnectionError("peer closed the connection")
    got += k
  return buf


def serve_handshake(sock, secret: bytes, num_workers: int) -> int:
  """The server's half: returns the authenticated worker index of the client.

  Raises:
    Refused: the client does not speak the protocol, or does not know the secret.
    OSError: the connection failed or timed out.
  """
  nonce_s = secrets.token_bytes(_NONCE)
  sock.sendall(MAGIC + nonce_s)
  answer = bytes(recv_exact(sock, ANSWER_BYTES))
  magic, rest = answer[:len(MAGIC)], answer[len(MAGIC):]
  if magic != MAGIC:
    raise Refused("not a tfdp side-channel client (no handshake)", "handshake")
  index = rest[:_INDEX.size]
  nonce_c = rest[_INDEX.size:_INDEX.size + _NONCE]
  mac = rest[_INDEX.size + _NONCE:]
  if not hmac.compare_digest(mac, _mac(secret, b"C", nonce_s, nonce_c, index)):
    raise Refused("failed authentication: not a worker of this job", "auth")
  (worker,) = _INDEX.unpack(index)
  if worker >= num_workers:
    raise Refused(f"claims worker {worker} of a job of {num_workers}", "auth")
  sock.sendall(_mac(secret, b"S", nonce_s, nonce_c, index))
  return worker


def client_handshake(sock, secret: bytes, worker: int) -> None:
  """The client's half, as worker `worker`.

  Raises:
    ConnectionError: the server is not a worker of this job.
    OSError: the connection failed or timed out.
  """
  hello = bytes(recv_exact(sock, HELLO_BYTES))
  if hello[:len(MAGIC)] != MAGIC:
    raise ConnectionError("the peer does not speak tfdp's side channel")
  nonce_s, nonce_c = hello[len(MAGIC):], secrets.token_bytes(_NONCE)
  index = _INDEX.pack(worker)
  sock.sendall(MAGIC + index + nonce_c + _mac(secret, b"C", nonce_s, nonce_c, index))
  proof = bytes(recv_exact(sock, _MAC))
  if not hmac.compare_digest(proof, _mac(secret, b"S", nonce_s, nonce_c, index)):
    raise ConnectionError("the peer is not a worker of this job (wrong proof)")


# -- frames --

def frame(header: dict, blobs=()) -> list:
  """A message as buffers: its header's length, the header (JSON), the blobs."""
  blobs = [memoryview(b).cast("B") for b in blobs]
  head = json.dumps(dict(header, sizes=[b.nbytes for b in blobs])).encode()
  return [struct.pack("<Q", len(head)) + head] + blobs


def send(sock, header: dict, blobs=()) -> None:
  for part in frame(header, blobs):
    sock.sendall(part)


def send_file(sock, header: dict, path: str, size: int, halfway=None) -> None:
  """A message whose one blob is the first `size` bytes of a file, sent by the kernel (sendfile).

  Args:
    sock: the authenticated socket.
    header: the header (its `sizes` are [size]).
    path: the file (a local copy's slot).
    size: its bytes to send.
    halfway: called once half of them are sent (a fault point of the tests).
  """
  head = json.dumps(dict(header, sizes=[size])).encode()
  sock.sendall(struct.pack("<Q", len(head)) + head)
  with open(path, "rb") as f:
    if sock.sendfile(f, 0, size // 2) != size // 2:
      raise ConnectionError(f"{path} is shorter than {size} bytes")
    if halfway is not None:
      halfway()
    if sock.sendfile(f, size // 2, size - size // 2) != size - size // 2:
      raise ConnectionError(f"{path} is shorter than {size} bytes")


def read_header(sock) -> dict | None:
  """The next frame's header, parsed but not yet checked; None when the peer closed between frames.

  Raises:
    Refused: an oversized or unparsable header.
  """
  first = sock.recv(1)
  if not first:
    return None
  (n,) = struct.unpack("<Q", bytes(first) + bytes(recv_exact(sock, 7)))
  if n > MAX_HEADER_BYTES:
    raise Refused(f"a header of {n} bytes (more than {MAX_HEADER_BYTES})", "header")
  try:
    header = json.loads(bytes(recv_exact(sock, n)))
  except (UnicodeDecodeError, ValueError) as e:
    raise Refused(f"a header that is not JSON ({e})", "header") from None
  if not isinstance(header, dict):
    raise Refused("a header that is not a JSON object", "header")
  return header


def read_blobs(sock, sizes) -> list[bytearray]:
  return [recv_exact(sock, size) for size in sizes]


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def check_header(header: dict, sender: int, num_workers: int) -> None:
  """Checks every field of a frame's header from authenticated worker `sender`.

  Raises:
    Refused: naming the first field that is wrong.
  """
  kind = header.get("kind")
  if kind not in _FIELDS:
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
    if (not isinstance(keys, list) or len(keys) != len(sizes) or len(set(keys)) != len(keys)
        or not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys)):
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
  for key, blob in zip(description["keys"], blobs):
    proto = tensor_pb2.TensorProto()
    try:
      proto.ParseFromString(bytes(blob))
      out[key] = tf.io.parse_tensor(bytes(blob), tf.dtypes.as_dtype(proto.dtype))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"per-worker tensor {key!r} does not parse: {e}") from e
  return out
