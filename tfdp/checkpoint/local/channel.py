"""The side channel's authenticated connections: a handshake naming both ends, MAC'd frames, and who may hold a slot.

A connection is authenticated before any frame is read: the server sends
its worker index and a fresh nonce; the client checks it reached the
worker it meant, and answers with its index, its own nonce and an
HMAC-SHA256 under the job's secret (tfdp.distribute.cluster.shared_secret) of both
indices, both nonces and the direction; the server refuses a client
claiming the server's own index (a reflected hello) and proves it knows
the secret the same way, in the other direction, all within HANDSHAKE_S.
Each side then derives one key per direction from the secret and the
whole handshake, and every frame after it carries MACs under its
direction's key and sequence number (`Channel`): a frame cannot be
injected, replayed, reflected or spliced from another connection. `Door`
decides who holds the server's slots: a connection still in its handshake
is evicted (oldest first) when they are full, and one worker holds a few.

What MACs what: the handshake and each frame's header, HMAC-SHA256 (small);
each frame's blobs (a copy: every byte of a slot), keyed BLAKE3
(`blobs_mac`: several times HMAC-SHA256's speed on one core, out of the
GIL), so that authenticating a copy costs little beside moving it. Sound:
keyed BLAKE3 is a PRF, hence a MAC for any number of messages under one
key (it needs no one-time key or nonce, unlike Poly1305 or GMAC), with a
256-bit key and tag; `blobs_key` derives its key from the direction's key
with a label of its own (no key serves two constructions); the frame's
sequence number comes first in what it MACs, as in its header's MAC, which
states the blobs' sizes (blobs replayed, reordered or moved to another
frame fail); tags are compared in constant time (hmac.compare_digest).
"""

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time

from absl import logging
import blake3

from tfdp.checkpoint.local import wire

MAGIC = b"tfdp-peer-v3"  # v3: a frame's blobs are MAC'd with keyed BLAKE3 (v2: HMAC-SHA256).
_NONCE = 32
_MAC = hashlib.sha256().digest_size
BLOBS_MAC = blake3.blake3.digest_size  # The trailer after a frame's blobs.
_INDEX = struct.Struct("<I")
HELLO_BYTES = len(MAGIC) + _INDEX.size + _NONCE  # server -> client
ANSWER_BYTES = len(MAGIC) + _INDEX.size + _NONCE + _MAC  # client -> server
# The whole handshake, not each read: a connection that has not authenticated
# by then is dropped (a trickle of bytes holds no slot).
HANDSHAKE_S = 3.0
_TO_SERVER, _TO_CLIENT = b"client->server", b"server->client"
_READ_CHUNK = 2 << 20  # A copy's file is read for its MAC this much at a time (stays in the cache).


def _transcript(server: int, client: int, nonce_s: bytes, nonce_c: bytes) -> bytes:
  return MAGIC + _INDEX.pack(server) + _INDEX.pack(client) + nonce_s + nonce_c


def _mac(secret: bytes, direction: bytes, transcript: bytes) -> bytes:
  return hmac.new(secret, direction + transcript, hashlib.sha256).digest()


def blobs_key(direction_key: bytes) -> bytes:
  """The key of `blobs_mac` for a direction: derived from its key (key separation) with a label of its own."""
  return hmac.new(direction_key, b"tfdp-peer blobs blake3", hashlib.sha256).digest()


def blobs_mac(key: bytes, seq: int):
  """The MAC of frame `seq`'s blobs (keyed BLAKE3 under `key`, from `blobs_key`), fed `seq` already.

  The one place that names the construction: the side channel's frames and
  scripts/bench_peer_transfer.py's authenticated floor use it.

  Returns:
    An object with `update(buffer)` (releases the GIL) and `digest()` (BLOBS_MAC bytes).
  """
  return blake3.blake3(b"blobs" + wire.LENGTH.pack(seq), key=key)


def _keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
  """(client->server key, server->client key) of one connection (HKDF-style: extract, then expand)."""
  base = hmac.new(secret, b"tfdp-peer keys" + transcript, hashlib.sha256).digest()
  return tuple(hmac.new(base, d, hashlib.sha256).digest() for d in (_TO_SERVER, _TO_CLIENT))


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
    wire.Refused: the client does not speak the protocol, does not know the
      secret, or claims this worker's own index.
    OSError: the connection failed or timed out.
  """
  deadline = time.monotonic() + HANDSHAKE_S if deadline is None else deadline
  sock.settimeout(HANDSHAKE_S)
  nonce_s = secrets.token_bytes(_NONCE)
  sock.sendall(MAGIC + _INDEX.pack(me) + nonce_s)
  answer = bytes(wire.recv_exact(sock, ANSWER_BYTES, deadline))
  magic, rest = answer[:len(MAGIC)], answer[len(MAGIC):]
  if magic != MAGIC:
    raise wire.Refused("not a tfdp side-channel client (no handshake)", "handshake")
  (client,) = _INDEX.unpack(rest[:_INDEX.size])
  nonce_c = rest[_INDEX.size:_INDEX.size + _NONCE]
  mac = rest[_INDEX.size + _NONCE:]
  transcript = _transcript(me, client, nonce_s, nonce_c)
  if not hmac.compare_digest(mac, _mac(secret, _TO_SERVER, transcript)):
    raise wire.Refused("failed authentication: not a worker of this job", "auth")
  if client == me:
    raise wire.Refused(f"a client claiming this worker's own index {me} (a reflected handshake)",
                  "reflect")
  if client >= num_workers:
    raise wire.Refused(f"claims worker {client} of a job of {num_workers}", "auth")
  sock.sendall(_mac(secret, _TO_CLIENT, transcript))
  to_server, to_client = _keys(secret, transcript)
  return client, Channel(sock, send_key=to_client, recv_key=to_server)


def client_handshake(sock, secret: bytes, me: int, to: int) -> "Channel":
  """The client's half, as worker `me` connecting to worker `to`: the connection's Channel.

  Raises:
    ConnectionError: the server is not worker `to` of this job.
    OSError: the connection failed, or the handshake took over HANDSHAKE_S.
  """
  timeout, deadline = sock.gettimeout(), time.monotonic() + HANDSHAKE_S
  hello = bytes(wire.recv_exact(sock, HELLO_BYTES, deadline))
  if hello[:len(MAGIC)] != MAGIC:
    raise ConnectionError("the peer does not speak tfdp's side channel")
  (server,) = _INDEX.unpack(hello[len(MAGIC):len(MAGIC) + _INDEX.size])
  if server != to:
    raise ConnectionError(f"the peer says it is worker {server}, not worker {to} "
                          "(a reflected or misdirected handshake)")
  nonce_s, nonce_c = hello[len(MAGIC) + _INDEX.size:], secrets.token_bytes(_NONCE)
  transcript = _transcript(to, me, nonce_s, nonce_c)
  sock.sendall(MAGIC + _INDEX.pack(me) + nonce_c + _mac(secret, _TO_SERVER, transcript))
  proof = bytes(wire.recv_exact(sock, _MAC, deadline))
  if not hmac.compare_digest(proof, _mac(secret, _TO_CLIENT, transcript)):
    raise ConnectionError("the peer is not a worker of this job (wrong proof)")
  sock.settimeout(timeout)
  to_server, to_client = _keys(secret, transcript)
  return Channel(sock, send_key=to_server, recv_key=to_client)


class Channel:
  """An authenticated connection (from the handshake): every frame carries MACs under this connection's keys.

  A frame's header is followed by the MAC of (its direction's sequence
  number, the header), so it is checked before anything acts on it; its
  blobs are followed by the MAC of (the sequence number, the blobs):
  `blobs_mac`, under the direction's `blobs_key`, which `end_frame` checks
  before the caller keeps anything of them. The receiver reads blobs
  through `recv_into` or `read_blobs`, which feed that MAC, or through
  `blob_reader` (a copy's bytes: another thread feeds it). The socket's
  other calls (settimeout, close, ...) pass through.

  Args:
    sock: the socket.
    send_key: the key of this end's direction.
    recv_key: the key of the other direction.
  """

  def __init__(self, sock, send_key: bytes, recv_key: bytes):
    self.sock = sock
    self._send_key, self._recv_key = send_key, recv_key
    self._send_blobs_key, self._recv_blobs_key = blobs_key(send_key), blobs_key(recv_key)
    self._sent = self._got = 0
    self._blob_mac = None

  def __getattr__(self, name):  # settimeout, sendall, shutdown, fileno, getpeername ...
    return getattr(self.sock, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.sock.close()

  def _header_mac(self, key, seq, head):
    return hmac.new(key, b"header" + wire.LENGTH.pack(seq) + head, hashlib.sha256).digest()

  def start_frame(self, head: bytes):
    """Sends a frame's header (the bytes `head`) and its MAC; returns the MAC its blobs feed."""
    seq, self._sent = self._sent, self._sent + 1
    self.sock.sendall(wire.LENGTH.pack(len(head)) + head + self._header_mac(self._send_key, seq, head))
    return blobs_mac(self._send_blobs_key, seq)

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

  def send_file(self, header: dict, path: str, size: int) -> None:
    """A frame whose one blob is the first `size` bytes of a file (sent by the kernel: sendfile).

    The kernel sends the bytes in one sendfile call while a thread of its
    own computes their MAC from the page cache (it releases the GIL),
    instead of each piece's MAC before its send. Bytes that changed between
    the two reads fail the receiver's check of the MAC.

    Args:
      header: the header (its `sizes` are [size]).
      path: the file (a local copy's slot).
      size: its bytes to send.
    """
    mac = self.start_frame(json.dumps(dict(header, sizes=[size])).encode())
    with open(path, "rb") as f:
      hashing = _FileMac(f.fileno(), size, mac)
      thread = threading.Thread(target=hashing.run, name="tfdp-send-mac", daemon=True)
      thread.start()
      try:
        sent = self.sock.sendfile(f, 0, size) if size else 0
      except BaseException:
        hashing.stop = True
        raise
      finally:
        thread.join()
      if sent != size or hashing.short:
        raise ConnectionError(f"{path} is shorter than {size} bytes")
    self.sock.sendall(mac.digest())

  def read_header(self) -> dict | None:
    """The next frame's header, its MAC checked, parsed but not yet checked; None when the peer closed between frames.

    Raises:
      Refused: an oversized, forged, replayed or unparsable header.
    """
    n = wire.read_length(self.sock)
    if n is None:
      return None
    raw = bytes(wire.recv_exact(self.sock, n + _MAC))
    head, mac = raw[:n], raw[n:]
    seq, self._got = self._got, self._got + 1
    if not hmac.compare_digest(mac, self._header_mac(self._recv_key, seq, head)):
      raise wire.Refused("a frame whose MAC is not this connection's (injected, replayed or spliced)",
                    "frame MAC")
    self._blob_mac = blobs_mac(self._recv_blobs_key, seq)
    return wire.parse_header(head)

  def recv_into(self, view) -> int:
    """Like socket.recv_into, for the current frame's blobs (they feed its MAC)."""
    k = self.sock.recv_into(view)
    if k:
      self._blob_mac.update(view[:k])
    return k

  def blob_reader(self):
    """(recv_into, authenticate) for the current frame's blobs, when another thread feeds the MAC.

    `recv_into` is the socket's own; every byte it delivers must go to
    `authenticate`, in order (tfdp.checkpoint.format.slot_file.receive feeds
    it as it checks what landed). A byte left out fails `end_frame`.
    """
    return self.sock.recv_into, self._blob_mac.update

  def read_blobs(self, sizes) -> list[bytearray]:
    """The current frame's blobs, each growing as its bytes arrive (not yet authenticated: `end_frame`)."""
    return [wire.grow_into(self.recv_into, size) for size in sizes]

  def end_frame(self) -> None:
    """Checks the MAC of the current frame's blobs (all read).

    Raises:
      Refused: they are not what the header's sender sent.
    """
    mac = bytes(wire.recv_exact(self.sock, BLOBS_MAC))
    expected, self._blob_mac = self._blob_mac.digest(), None
    if not hmac.compare_digest(mac, expected):
      raise wire.Refused("a frame whose data does not match its MAC", "frame MAC")


class Refusals:
  """Dropped connections and frames: the first of each kind is logged, all are counted."""

  def __init__(self):
    self._lock = threading.Lock()
    self._seen = set()
    self.count = 0

  def note(self, where, error: wire.Refused) -> None:
    with self._lock:
      self.count += 1
      first = error.key not in self._seen
      self._seen.add(error.key)
    if first:
      logging.warning("tfdp: the local tier's side channel dropped a connection from %s: %s. "
                      "Nothing of it was written; the job goes on (more of this kind are "
                      "dropped without a line).", where, error)


class Door:
  """Who holds a server's connection slots: strangers in their handshake go first, a worker holds a few.

  Args:
    slots: connections served at once.
    per_peer: authenticated connections one worker may hold at once.
  """

  def __init__(self, slots: int, per_peer: int):
    self.slots, self.per_peer = slots, per_peer
    self._free = threading.BoundedSemaphore(slots)
    self._lock = threading.Lock()
    self._pending = {}  # connection -> when it was accepted, while in its handshake
    self._authed = {}  # worker -> its authenticated connections open now

  def admit(self, conn) -> bool:
    """Takes a slot for `conn` (in its handshake), evicting the oldest stranger's when none is free."""
    if not self._free.acquire(blocking=False):
      if not (self._evict() and self._free.acquire(timeout=HANDSHAKE_S)):
        return False
    with self._lock:
      self._pending[conn] = time.monotonic()
    return True

  def _evict(self) -> bool:
    """Cuts the oldest connection still in its handshake (its thread then `leave`s)."""
    with self._lock:
      if not self._pending:
        return False
      conn = min(self._pending, key=self._pending.get)
      del self._pending[conn]
    try:
      conn.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    return True

  def authenticated(self, conn, worker: int) -> None:
    """`conn` is worker `worker`'s now (no longer evictable); call `leave(conn, worker)` after.

    Raises:
      wire.Refused: that worker holds `per_peer` connections already.
    """
    with self._lock:
      self._pending.pop(conn, None)
      self._authed[worker] = self._authed.get(worker, 0) + 1
      if self._authed[worker] > self.per_peer:
        raise wire.Refused(f"worker {worker} holds more than {self.per_peer} connections at "
                           "once", "limit")

  def leave(self, conn, worker: int | None = None) -> None:
    """Frees `conn`'s slot (`worker`: whose it was, once `authenticated`)."""
    with self._lock:
      self._pending.pop(conn, None)
      if worker is not None:
        self._authed[worker] -= 1
    self._free.release()


class _FileMac:
  """Feeds a MAC the first `size` bytes of a file (by pread, a piece at a time), on a thread of its own.

  `short`: the file ended first. Setting `stop` ends it early (the send failed).
  """

  def __init__(self, fd: int, size: int, mac):
    self._fd, self._size, self._mac = fd, size, mac
    self.short, self.stop = False, False

  def run(self) -> None:
    buf = bytearray(min(self._size, _READ_CHUNK))
    view, at = memoryview(buf), 0
    while at < self._size and not self.stop:
      n = os.preadv(self._fd, [view[:min(self._size - at, len(buf))]], at)
      if n <= 0:
        self.short = True
        return
      self._mac.update(view[:n])
      at += n
