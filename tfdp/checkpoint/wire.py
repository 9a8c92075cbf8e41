"""The side channel's wire: a handshake naming both ends on the job's secret, MAC'd frames, and what a header may hold.

Nothing in this module trusts the wire. A connection is authenticated
before any frame is read: the server sends its worker index and a fresh
nonce; the client checks it reached the worker it meant, and answers with
its index, its own nonce and an HMAC-SHA256 under the job's secret
(tfdp.cluster.shared_secret) of both indices, both nonces and the
direction; the server refuses a client claiming the server's own index (a
reflected hello) and proves it knows the secret the same way, in the other
direction. Each side then derives two keys (one per direction) from the
secret and the whole handshake, and every frame after it carries MACs under
its direction's key and its sequence number (`Channel`): a frame cannot be
injected, replayed, reflected or spliced from another connection. A frame
is an 8-byte length, a JSON header (of bounded size and depth) and its MAC,
the blobs, then the blobs' MAC; blobs are read as they arrive, never
allocated whole from a header. `check_header` validates every field of a
header (known kind, integer worker ids in range, integer steps, bounded
sizes) before anything acts on it, and no path is ever made from a header.
"""

import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import time

import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.framework import types_pb2

MAGIC = b"tfdp-peer-v2"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_INDEX = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
HELLO_BYTES = len(MAGIC) + _INDEX.size + _NONCE  # server -> client
ANSWER_BYTES = len(MAGIC) + _INDEX.size + _NONCE + _MAC  # client -> server
# The whole handshake, not each read: a connection that has not authenticated
# by then is dropped (a trickle of bytes holds no slot).
HANDSHAKE_S = 3.0
_TO_SERVER, _TO_CLIENT = b"client->server", b"server->client"

# Bounds on what a header may ask for.
MAX_HEADER_BYTES = 4 << 20  # A copy's header holds its manifest (every tensor's key).
MAX_HEADER_DEPTH = 8  # Nesting of a header's JSON ([] and {}); the protocol's needs 2.
MAX_BLOBS = 4096
MAX_KEY_CHARS = 4096
MAX_TOKEN_CHARS = 128
MAX_STEP = 2 ** 53
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


def _transcript(server: int, client: int, nonce_s: bytes, nonce_c: bytes) -> bytes:
  return MAGIC + _INDEX.pack(server) + _INDEX.pack(client) + nonce_s + nonce_c


def _mac(secret: bytes, direction: bytes, transcript: bytes) -> bytes:
  return hmac.new(secret, direction + transcript, hashlib.sha256).digest()


def _keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
  """(client->server key, server->client key) of one connection (HKDF-style: extract, then expand)."""
  base = hmac.new(secret, b"tfdp-peer keys" + transcript, hashlib.sha256).digest()
  return tuple(hmac.new(base, d, hashlib.sha256).digest() for d in (_TO_SERVER, _TO_CLIENT))


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


def serve_handshake(sock, secret: bytes, me: int, num_workers: int,
                    deadline: float | None = None) -> tuple[int, "Channel"]:
  """The server's half, as worker `me`: (the authenticated client's index, the connection's Channel).

  Args:
    sock: the accepted socket.
    secret: the job's key.
    me: this worker's index.
    num_workers: the job's workers.
    deadline: a time.monotonic() by which the handshake must be done
      (default: HANDSHAKE_S from now).

  Raises:
    Refused: the client does not speak the protocol, does not know the
      secret, or claims this worker's own index.
    OSError: the connection failed or timed out.
  """
  deadline = time.monotonic() + HANDSHAKE_S if deadline is None else deadline
  sock.settimeout(HANDSHAKE_S)
  nonce_s = secrets.token_bytes(_NONCE)
  sock.sendall(MAGIC + _INDEX.pack(me) + nonce_s)
  answer = bytes(recv_exact(sock, ANSWER_BYTES, deadline))
  magic, rest = answer[:len(MAGIC)], answer[len(MAGIC):]
  if magic != MAGIC:
    raise Refused("not a tfdp side-channel client (no handshake)", "handshake")
  (client,) = _INDEX.unpack(rest[:_INDEX.size])
  nonce_c = rest[_INDEX.size:_INDEX.size + _NONCE]
  mac = rest[_INDEX.size + _NONCE:]
  transcript = _transcript(me, client, nonce_s, nonce_c)
  if not hmac.compare_digest(mac, _mac(secret, _TO_SERVER, transcript)):
    raise Refused("failed authentication: not a worker of this job", "auth")
  if client == me:
    raise Refused(f"a client claiming this worker's own index {me} (a reflected handshake)",
                  "reflect")
  if client >= num_workers:
    raise Refused(f"claims worker {client} of a job of {num_workers}", "auth")
  sock.sendall(_mac(secret, _TO_CLIENT, transcript))
  to_server, to_client = _keys(secret, transcript)
  return client, Channel(sock, send_key=to_client, recv_key=to_server)


def client_handshake(sock, secret: bytes, me: int, to: int) -> "Channel":
  """The client's half, as worker `me` connecting to worker `to`: the connection's Channel.

  Raises:
    ConnectionError: the server is not worker `to` of this job.
    OSError: the connection failed or timed out.
  """
  hello = bytes(recv_exact(sock, HELLO_BYTES))
  if hello[:len(MAGIC)] != MAGIC:
    raise ConnectionError("the peer does not speak tfdp's side channel")
  (server,) = _INDEX.unpack(hello[len(MAGIC):len(MAGIC) + _INDEX.size])
  if server != to:
    raise ConnectionError(f"the peer says it is worker {server}, not worker {to} "
                          "(a reflected or misdirected handshake)")
  nonce_s, nonce_c = hello[len(MAGIC) + _INDEX.size:], secrets.token_bytes(_NONCE)
  transcript = _transcript(to, me, nonce_s, nonce_c)
  sock.sendall(MAGIC + _INDEX.pack(me) + nonce_c + _mac(secret, _TO_SERVER, transcript))
  proof = bytes(recv_exact(sock, _MAC))
  if not hmac.compare_digest(proof, _mac(secret, _TO_CLIENT, transcript)):
    raise ConnectionError("the peer is not a worker of this job (wrong proof)")
  to_server, to_client = _keys(secret, transcript)
  return Channel(sock, send_key=to_server, recv_key=to_client)


# -- frames --

def frame(header: dict, blobs=()) -> list:
  """A message as buffers, unauthenticated: its header's length, the header (JSON), the blobs.

  The format of a kept per-worker state's file (tfdp.checkpoint.replicas);
  on the wire, `Channel.send` adds the MACs.
  """
  blobs = [memoryview(b).cast("B") for b in blobs]
  head = json.dumps(dict(header, sizes=[b.nbytes for b in blobs])).encode()
  return [_LENGTH.pack(len(head)) + head] + blobs


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
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


def _read_length(sock) -> int | None:
  first = sock.recv(1)
  if not first:
    return None
  (n,) = _LENGTH.unpack(bytes(first) + bytes(recv_exact(sock, _LENGTH.size - 1)))
  if n > MAX_HEADER_BYTES:
    raise Refused(f"a header of {n} bytes (more than {MAX_HEADER_BYTES})", "header")
  return n


def _grow_into(recv_into, size: int) -> bytearray:
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


class Channel:
  """An authenticated connection (from the handshake): every frame carries MACs under this connection's keys.

  A frame's header is followed by the MAC of (its direction's sequence
  number, the header), so it is checked before anything acts on it; its
  blobs are followed by the MAC of (the sequence number, the blobs), which
  `end_frame` checks before the caller keeps anything of them. The
  receiver reads blobs through `recv_into` or `read_blobs`, which feed that
  MAC. The socket's other calls (settimeout, close, ...) pass through.

  Args:
    sock: the socket.
    send_key: the key of this end's direction.
    recv_key: the key of the other direction.
  """

  def __init__(self, sock, send_key: bytes, recv_key: bytes):
    self.sock = sock
    self._send_key, self._recv_key = send_key, recv_key
    self._sent = self._got = 0
    self._blob_mac = None

  def __getattr__(self, name):  # settimeout, sendall, shutdown, fileno, getpeername ...
    return getattr(self.sock, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.sock.close()

  def _header_mac(self, key, seq, head):
    return hmac.new(key, b"header" + _LENGTH.pack(seq) + head, hashlib.sha256).digest()

  def _blobs_mac(self, key, seq):
    return hmac.new(key, b"blobs" + _LENGTH.pack(seq), hashlib.sha256)

  def start_frame(self, head: bytes):
    """Sends a frame's header (the bytes `head`) and its MAC; returns the MAC its blobs feed."""
    seq, self._sent = self._sent, self._sent + 1
    self.sock.sendall(_LENGTH.pack(len(head)) + head + self._header_mac(self._send_key, seq, head))
    return self._blobs_mac(self._send_key, seq)

  def send_raw(self, head: bytes, blobs=()) -> None:
    """Sends a frame whose header is the bytes `head` (tests send malformed ones through it)."""
    mac = self.start_frame(head)
    for blob in blobs:
      mac.update(blob)
      self.sock.sendall(blob)
    self.sock.sendall(mac.digest())

  def send(self, header: dict, blobs=()) -> None:
    """Sends a frame: `header` (its `sizes` filled in) and `blobs`."""
    blobs = [memoryview(b).cast("B") for b in blobs]
    self.send_raw(json.dumps(dict(header, sizes=[b.nbytes for b in blobs])).encode(), blobs)

  def send_file(self, header: dict, path: str, size: int, halfway=None) -> None:
    """A frame whose one blob is the first `size` bytes of a file (sent by the kernel: sendfile).

    Args:
      header: the header (its `sizes` are [size]).
      path: the file (a local copy's slot).
      size: its bytes to send.
      halfway: called once half of them are sent (a fault point of the tests).
    """
    mac = self.start_frame(json.dumps(dict(header, sizes=[size])).encode())
    with open(path, "rb") as f:
      for start, end in ((0, size // 2), (size // 2, size)):
        f.seek(start)
        left = end - start
        while left:  # The MAC reads the page cache; the bytes go by sendfile.
          chunk = f.read(min(left, 8 * _CHUNK))
          if not chunk:
            raise ConnectionError(f"{path} is shorter than {size} bytes")
          mac.update(chunk)
          left -= len(chunk)
        if self.sock.sendfile(f, start, end - start) != end - start:
          raise ConnectionError(f"{path} is shorter than {size} bytes")
        if start == 0 and halfway is not None:
          halfway()
    self.sock.sendall(mac.digest())

  def read_header(self) -> dict | None:
    """The next frame's header, its MAC checked, parsed but not yet checked; None when the peer closed between frames.

    Raises:
      Refused: an oversized, forged, replayed or unparsable header.
    """
    n = _read_length(self.sock)
    if n is None:
      return None
    raw = bytes(recv_exact(self.sock, n + _MAC))
    head, mac = raw[:n], raw[n:]
    seq, self._got = self._got, self._got + 1
    if not hmac.compare_digest(mac, self._header_mac(self._recv_key, seq, head)):
      raise Refused("a frame whose MAC is not this connection's (injected, replayed or spliced)",
                    "frame MAC")
    self._blob_mac = self._blobs_mac(self._recv_key, seq)
    return parse_header(head)

  def recv_into(self, view) -> int:
    """Like socket.recv_into, for the current frame's blobs (they feed its MAC)."""
    k = self.sock.recv_into(view)
    if k:
      self._blob_mac.update(view[:k])
    return k

  def read_blobs(self, sizes) -> list[bytearray]:
    """The current frame's blobs, each growing as its bytes arrive (not yet authenticated: `end_frame`)."""
    return [_grow_into(self.recv_into, size) for size in sizes]

  def end_frame(self) -> None:
    """Checks the MAC of the current frame's blobs (all read).

    Raises:
      Refused: they are not what the header's sender sent.
    """
    mac = bytes(recv_exact(self.sock, _MAC))
    expected, self._blob_mac = self._blob_mac.digest(), None
    if not hmac.compare_digest(mac, expected):
      raise Refused("a frame whose data does not match its MAC", "frame MAC")


def send(sock, header: dict, blobs=()) -> None:
  """Sends a frame on `sock`: a Channel's (with MACs), or a plain socket's (unauthenticated framing)."""
  if isinstance(sock, Channel):
    sock.send(header, blobs)
    return
  for part in frame(header, blobs):
    sock.sendall(part)


def send_file(sock, header: dict, path: str, size: int, halfway=None) -> None:
  """A frame whose one blob is the first `size` bytes of a file (see Channel.send_file), on a Channel or a plain socket."""
  if isinstance(sock, Channel):
    sock.send_file(header, path, size, halfway)
    return
  head = json.dumps(dict(header, sizes=[size])).encode()
  sock.sendall(_LENGTH.pack(len(head)) + head)
  with open(path, "rb") as f:
    if sock.sendfile(f, 0, size // 2) != size // 2:
      raise ConnectionError(f"{path} is shorter than {size} bytes")
    if halfway is not None:
      halfway()
    if sock.sendfile(f, size // 2, size - size // 2) != size - size // 2:
      raise ConnectionError(f"{path} is shorter than {size} bytes")


def read_header(sock) -> dict | None:
  """The next frame's header on a Channel (MAC checked) or a plain socket; None when the peer closed.

  Raises:
    Refused: an oversized, forged or unparsable header.
  """
  if isinstance(sock, Channel):
    return sock.read_header()
  n = _read_length(sock)
  return None if n is None else parse_header(bytes(recv_exact(sock, n)))


def read_blobs(sock, sizes) -> list[bytearray]:
  """A frame's blobs, each growing as its bytes arrive."""
  if isinstance(sock, Channel):
    return sock.read_blobs(sizes)
  return [_grow_into(sock.recv_into, size) for size in sizes]


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
