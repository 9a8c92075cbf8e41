"""The local tier's side channel between workers: raw TCP, off the training thread.

Two uses, both moving bytes once:
- after each local save, a worker sends its per-worker state (the data
  position) to its neighbour (worker i+1 mod N), which keeps the newest ones
  in its own local tier (`PeerCopies`): a replaced host gets it back;
- at a restore where a worker lost its local copy, a holder sends it the
  copy's files, and its neighbour its per-worker state.

The workers learn each other's ports with one small all-reduce when the
link starts (every worker starts it at the same point, as any collective).
A message is an 8-byte length, a JSON header and a payload of byte blobs.
"""

import collections
import json
import os
import socket
import struct
import threading
import time

from absl import logging
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

from tfdp import cluster
from tfdp.checkpoint import layout as layout_lib

_CONNECT_TIMEOUT_S = 5.0
_RETRY_S = 30.0  # After a failed send, the neighbour is tried again this much later.
_CHUNK = 4 << 20  # A received file is written as it arrives, this much at a time.


def _frame(header: dict, blobs=()) -> list:
  """A message as buffers: its header's length, the header (JSON), the blobs."""
  blobs = [memoryview(b).cast("B") for b in blobs]
  head = json.dumps(dict(header, sizes=[b.nbytes for b in blobs])).encode()
  return [struct.pack("<Q", len(head)) + head] + blobs


def _send(sock, header: dict, blobs=()) -> None:
  for part in _frame(header, blobs):
    sock.sendall(part)


def _send_files(sock, header: dict, paths) -> None:
  """A message whose blobs are files, sent by the kernel (sendfile), not read into memory."""
  sizes = [os.path.getsize(p) for p in paths]
  head = json.dumps(dict(header, sizes=sizes)).encode()
  sock.sendall(struct.pack("<Q", len(head)) + head)
  for path in paths:
    with open(path, "rb") as f:
      sock.sendfile(f)


def _recv_exact(sock, n: int) -> bytearray:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:])
    if not k:
      raise ConnectionError("peer closed the connection")
    got += k
  return buf


def _recv(sock, spool=None):
  """One message: (header, blobs); with `spool(header)` -> paths, its blobs go straight to those files."""
  (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
  header = json.loads(bytes(_recv_exact(sock, n)))
  paths = spool(header) if spool is not None else None
  if paths is None:
    return header, [_recv_exact(sock, size) for size in header["sizes"]]
  chunk = bytearray(_CHUNK)
  view = memoryview(chunk)
  for path, size in zip(paths, header["sizes"]):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      left = size
      while left:
        k = sock.recv_into(view[:min(left, _CHUNK)])
        if not k:
          raise ConnectionError("peer closed the connection")
        os.write(fd, view[:k])
        left -= k
    finally:
      os.close(fd)
  return header, paths


def tensors_to_wire(tensors: dict) -> tuple[dict, list]:
  """{key: tensor} as (a JSON-able description, the blobs): each tensor's `serialize_tensor` bytes."""
  keys = sorted(tensors)
  return {"keys": keys}, [tf.io.serialize_tensor(tensors[k]).numpy() for k in keys]


def tensors_from_wire(description: dict, blobs) -> dict:
  """The inverse of `tensors_to_wire` (dtypes travel inside the serialized tensors)."""
  out = {}
  for key, blob in zip(description["keys"], blobs):
    proto = tensor_pb2.TensorProto()
    proto.ParseFromString(bytes(blob))
    out[key] = tf.io.parse_tensor(bytes(blob), tf.dtypes.as_dtype(proto.dtype))
  return out


class PeerCopies:
  """The per-worker states a worker keeps of its neighbour: `<local dir>/peer-<from>/<name>-<step>`.

  Each is one file in the side channel's own framing (a JSON header, then
  the tensors' bytes), written to a temp name and renamed: whole or absent.
  The newest `keep` of each source are kept.
  """

  def __init__(self, directory: str, name: str, keep: int):
    self.directory, self.name, self.keep = directory, name, keep
    self._lock = threading.Lock()

  def _path(self, source: int, step: int) -> str:
    return os.path.join(layout_lib.peer_dir(self.directory, source), f"{self.name}-{step}")

  def put(self, source: int, step: int, description: dict, blobs) -> None:
    path = self._path(source, step)
    tmp = layout_lib.atomic_tmp_path(path)
    with self._lock:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      try:
        os.writev(fd, _frame(dict(description, step=step, source=source), blobs))
      finally:
        os.close(fd)
      os.replace(tmp, path)
      for old in self.steps(source)[:-self.keep]:
        os.remove(self._path(source, old))

  def steps(self, source: int) -> list[int]:
    """The steps of `source`'s per-worker state held here, oldest first."""
    folder = layout_lib.peer_dir(self.directory, source)
    prefix = self.name + "-"
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(n[len(prefix):]) for n in names
                  if n.startswith(prefix) and n[len(prefix):].isdigit())

  def get(self, source: int, step: int) -> tuple[dict, list] | None:
    """(description, blobs) of `source`'s per-worker state at `step`, or None."""
    try:
      with open(self._path(source, step), "rb") as f:
        raw = f.read()
    except OSError:
      return None
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    blobs, at = [], 8 + n
    for size in header["sizes"]:
      blobs.append(raw[at:at + size])
      at += size
    return header, blobs

  def drop(self) -> None:
    """Deletes every peer copy held here."""
    for source in layout_lib.peer_sources(self.directory):
      folder = layout_lib.peer_dir(self.directory, source)
      for n in os.listdir(folder):
        os.remove(os.path.join(folder, n))
      os.rmdir(folder)


class PeerLink:
  """This worker's end of the side channel: a server thread, and sends to the others.

  Args:
    me: this worker (with every worker's address and the strategy).
    copies: where this worker keeps its neighbour's per-worker states.
  """

  def __init__(self, me: cluster.Worker, copies: PeerCopies):
    self._me = me
    self.copies = copies
    host = (me.address or "localhost").rsplit(":", 1)[0]
    self._server = socket.create_server((host, 0), reuse_port=False)
    self._server.settimeout(None)
    port = self._server.getsockname()[1]
    # Every worker's port, by one all-reduce (all workers start the link together).
    ports = cluster.gather([port], me.strategy)[:, 0]
    self._peers = [(a.rsplit(":", 1)[0], int(p)) for a, p in zip(me.addresses, ports)]
    self._mailbox = collections.defaultdict(list)
    self._arrived = threading.Condition()
    self._neighbour_sock = None
    self._neighbour_down_until = 0.0
    # `fn(header)` -> where the files of a message go (None: into memory).
    self.spool = None
    threading.Thread(target=self._serve, name="tfdp-peer-server", daemon=True).start()

  @property
  def neighbour(self) -> int:
    return (self._me.index + 1) % self._me.count

  @property
  def left(self) -> int:
    """The worker whose per-worker state this one keeps."""
    return (self._me.index - 1) % self._me.count

  # -- receiving --

  def _serve(self):
    while True:
      try:
        conn, _ = self._server.accept()
      except OSError:
        return
      threading.Thread(target=self._handle, args=(conn,), name="tfdp-peer-conn",
                       daemon=True).start()

  def _handle(self, conn):
    with conn:
      while True:
        try:
          header, blobs = _recv(conn, self.spool)
        except (ConnectionError, OSError, ValueError, struct.error) as e:
          if not isinstance(e, ConnectionError) or str(e) != "peer closed the connection":
            logging.warning("tfdp: a message from a peer was cut short: %s", e)
          return
        if header["kind"] == "per_worker":
          try:
            self.copies.put(header["from"], header["step"], header, blobs)
          except OSError as e:
            logging.warning("tfdp: could not keep worker %d's per-worker state: %s",
                            header["from"], e)
        else:
          with self._arrived:
            self._mailbox[(header["kind"], header["step"])].append((header, blobs))
            self._arrived.notify_all()

  def receive(self, kind: str, step: int, timeout: float):
    """Waits for a message of `kind` about `step` (sent by `send` during a restore)."""
    deadline = time.monotonic() + timeout
    with self._arrived:
      while not self._mailbox[(kind, step)]:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"no {kind} message about step {step} within {timeout:.0f}s")
        self._arrived.wait(left)
      return self._mailbox[(kind, step)].pop(0)

  # -- sending --

  def send(self, to: int, kind: str, step: int, header: dict, blobs=(), paths=()) -> None:
    """Sends one message to worker `to` on a connection of its own (restores): blobs, or files."""
    header = dict(header, kind=kind, step=step, **{"from": self._me.index})
    with socket.create_connection(self._peers[to], timeout=_CONNECT_TIMEOUT_S) as sock:
      sock.settimeout(None)
      if paths:
        _send_files(sock, dict(header, files=[os.path.basename(p) for p in paths]), paths)
      else:
        _send(sock, header, blobs)

  def replicate(self, step: int, tensors: dict, **extra) -> None:
    """Sends this worker's per-worker state at `step` to its neighbour (the writer thread calls it).

    A neighbour that cannot be reached is logged once and tried again later;
    training never waits for it.
    """
    if time.monotonic() < self._neighbour_down_until:
      return
    description, blobs = tensors_to_wire(tensors)
    try:
      if self._neighbour_sock is None:
        self._neighbour_sock = socket.create_connection(self._peers[self.neighbour],
                                                        timeout=_CONNECT_TIMEOUT_S)
        self._neighbour_sock.settimeout(_CONNECT_TIMEOUT_S)
      _send(self._neighbour_sock, dict(description, kind="per_worker", step=step,
                                       **{"from": self._me.index}, **extra), blobs)
    except OSError as e:
      if self._neighbour_down_until == 0.0:
        logging.warning("tfdp: cannot send the per-worker state to worker %d (%s); a "
                        "replaced host then restarts from the newest step all hold.",
                        self.neighbour, e)
      self._neighbour_down_until = time.monotonic() + _RETRY_S
      self.close_neighbour()

  def close_neighbour(self):
    if self._neighbour_sock is not None:
      try:
        self._neighbour_sock.close()
      except OSError:
        pass
      self._neighbour_sock = None
