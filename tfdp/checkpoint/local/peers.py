"""The local tier's side channel between workers: authenticated TCP, off the training thread.

Two uses, both moving bytes once:
- after each local save, a worker sends its per-worker state (the data
  position) to its neighbour (worker i+1 mod N), which keeps it
  (tfdp.checkpoint.local.replicas) and acknowledges it; a replaced host gets it
  back. Once its own copy is committed and its state acknowledged, the
  worker tells the others its part of the step is done: a step done by
  every worker is complete everywhere (tfdp.checkpoint.local.generations);
- at a restore where a worker lost its local copy, a holder sends it the
  copy's record and slot (sendfile), which land in a slot of the receiver
  with every tensor's CRC32C checked as its bytes arrive, and its
  neighbour sends it its per-worker state.

The link listens on this worker's own address only. Every connection is
authenticated with the job's secret, naming both ends, before a frame is
read, and every frame carries a MAC under the connection's own keys
(tfdp.checkpoint.local.channel); every header is checked (tfdp.checkpoint.local.wire).
At most `max_connections` are served at once: a handshake must finish
within channel.HANDSHAKE_S, a connection still in its handshake is evicted
(oldest first) when the slots are full, and one worker holds at most
PER_PEER_CONNECTIONS. A step far ahead of what this worker knows of the
job is refused, and a restore's message is accepted only when it is
expected, from the worker expected to send it. Anything else is dropped,
logged once per kind of problem, and nothing is written; no error from the
wire ends the server.
"""

import socket
import threading

from absl import logging

from tfdp.checkpoint.local import awaited as awaited_lib
from tfdp.checkpoint.local import channel as channel_lib
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.local import outbound as outbound_lib
from tfdp.checkpoint.local import wire

STALL_S = outbound_lib.STALL_S  # A transfer that moves no byte for this long has failed.
# With 2 ** 36 (64 GiB) a per-worker state is absurd: a header asking more is dropped.
MAX_PER_WORKER_BYTES = 1 << 36
# Authenticated connections one worker may hold at once: its reports, a
# copy and a state at a restore, and one being replaced.
PER_PEER_CONNECTIONS = 4


def max_connections(num_workers: int) -> int:
  """Connections served at once: the peers' few, and room for a restore."""
  return 2 * num_workers + 8


def own_host(address: str | None) -> str:
  """The host of this worker's `host:port` (brackets of an IPv6 address removed)."""
  host = (address or "localhost").rsplit(":", 1)[0]
  return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class PeerLink:
  """This worker's end of the side channel: a server thread, and sends to the others.

  Bound at construction; `start(peers)` begins serving once every worker's
  address is known (tfdp.checkpoint.local agrees on them).

  Args:
    me: this worker (`tfdp.distribute.cluster.Worker`).
    secret: the job's key (tfdp.distribute.cluster.shared_secret).
    directory: this worker's local-tier folder (what arrives must fit there).
    on_replica: `fn(source, step, header, blobs)` keeps a neighbour's
      per-worker state (raises wire.Refused to drop it).
    on_done: `fn(worker, step)`: that worker's part of `step` is done.
    incoming: `fn(step, manifest_json, sizes)` -> the checked offer
      (tfdp.checkpoint.local.copies.Incoming) of a copy a peer offers at a
      restore, or raises wire.Refused.
    own_step: `fn()` -> the newest step this worker holds (or None): what a
      peer's step is bounded by before this worker has sent one itself.
  """

  def __init__(self, me, secret: bytes, directory: str, *, on_replica, on_done, incoming,
               own_step=None):
    self._me, self._secret, self._directory = me, secret, directory
    self._on_replica, self._on_done, self._incoming = on_replica, on_done, incoming
    self._steps = wire.StepBound(own_step)
    self._host = own_host(me.address)
    self._server = socket.create_server((self._host, 0), reuse_port=False)
    self.port = self._server.getsockname()[1]
    self._lock = threading.Lock()
    self._conns, self._threads = set(), set()
    self._door = channel_lib.Door(max_connections(me.count), PER_PEER_CONNECTIONS)
    self._awaited = awaited_lib.Awaited()  # What a restore waits for.
    self._inbound = {}  # worker -> its connections open now that carried its reports
    self.gone = set()  # Workers whose every such connection ended (they report no more).
    self.refusals = channel_lib.Refusals()
    self._warned = set()
    self._sends = outbound_lib.Outbound(me, secret, self._steps, self._warn_once)
    self._closed = False
    self._accept = None

  def start(self, peers) -> None:
    """Serves, knowing every worker's (host, port) by index."""
    self._sends.peers = [tuple(p) for p in peers]
    self._accept = threading.Thread(target=self._serve, name="tfdp-peer-server", daemon=True)
    self._accept.start()

  @property
  def address(self) -> str:
    return f"{self._host}:{self.port}"

  @property
  def open(self) -> bool:
    return bool(self._sends.peers) and not self._closed

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
        conn, addr = self._server.accept()
      except OSError:
        return
      if self._closed:
        conn.close()
        return
      try:
        self._admit(conn, addr)
      except Exception as e:  # pylint: disable=broad-except
        conn.close()  # No thread to be had, or worse: the server goes on.
        self.refusals.note(str(addr), wire.Refused(f"not served ({e})", "error"))

  def _admit(self, conn, addr):
    """Serves `conn` in a thread of its own, if the door lets it in."""
    if not self._door.admit(conn):
      conn.close()
      self.refusals.note(f"{addr[0]}:{addr[1]}", wire.Refused(
          f"more than {max_connections(self._me.count)} connections at once", "limit"))
      return
    thread = threading.Thread(target=self._handle, args=(conn, addr), name="tfdp-peer-conn",
                              daemon=True)
    with self._lock:
      self._conns.add(conn)
      self._threads.add(thread)
    try:
      thread.start()
    except BaseException:
      with self._lock:
        self._conns.discard(conn)
        self._threads.discard(thread)
      self._door.leave(conn)
      raise

  def _handle(self, conn, addr):
    where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
    sender, reporting, authed, in_frame = None, False, False, False
    try:
      try:
        sender, channel = channel_lib.serve_handshake(conn, self._secret, self._me.index,
                                                      self._me.count)
      except OSError as e:  # Not even a handshake: a stranger, a port scan, or evicted.
        raise wire.Refused(f"the handshake did not complete ({e})", "handshake") from None
      authed = True
      self._door.authenticated(conn, sender)
      while not self._closed:
        channel.settimeout(None)  # An authenticated peer's connection idles between saves.
        header = channel.read_header()
        if header is None:
          return
        wire.check_header(header, sender, self._me.count)
        channel.settimeout(STALL_S)
        in_frame = True
        self._dispatch(channel, sender, header)
        in_frame = False
        if not reporting and header["kind"] in (wire.PER_WORKER, wire.DONE):
          reporting = True  # The connection its reports come by.
          self._count(sender, +1)
    except wire.Refused as e:
      self.refusals.note(where, e)
    except (OSError, ValueError) as e:
      if self._closed:
        pass
      elif in_frame:  # Its bytes stopped or did not check: nothing of it is kept.
        self.refusals.note(where, wire.Refused(f"a message cut short ({e})", "cut"))
      elif not (isinstance(e, ConnectionError) and str(e) == "peer closed the connection"):
        self._warn_once("cut", "tfdp: a message from a peer was cut short: %s", e)
    except Exception as e:  # pylint: disable=broad-except
      # Nothing from the wire ends a thread unseen: counted and logged like a refusal.
      self.refusals.note(where, wire.Refused(f"{type(e).__name__}: {str(e)[:200]}", "error"))
    finally:
      if reporting:
        self._count(sender, -1)
      try:
        conn.close()
      finally:
        with self._lock:
          self._conns.discard(conn)
          self._threads.discard(threading.current_thread())
        self._door.leave(conn, sender if authed else None)

  def _count(self, sender, change):
    """Counts a worker's connections that carry its reports: once all ended, it is gone."""
    with self._lock:
      self._inbound[sender] = self._inbound.get(sender, 0) + change
      if change > 0:
        self.gone.discard(sender)
      elif not self._inbound[sender] and not self._closed:
        self.gone.add(sender)

  def _check_space(self, nbytes):
    free = fs.free_bytes(self._directory) if nbytes else None
    if free is not None and nbytes > free:
      raise wire.Refused(f"{nbytes} bytes, {free} free in the local tier", "space")

  def _dispatch(self, conn, sender, header):
    kind, step, sizes = header["kind"], header["step"], header["sizes"]
    if kind == wire.PER_WORKER:
      if sender != self.left:
        raise wire.Refused(f"a per-worker state from worker {sender}, which is not this "
                           "worker's left neighbour", "neighbour")
      if sum(sizes) > MAX_PER_WORKER_BYTES:
        raise wire.Refused(f"a per-worker state of {sum(sizes)} bytes", "size")
      self._steps.check(kind, sender, step)
      self._check_space(sum(sizes))
      blobs = conn.read_blobs(sizes)
      conn.end_frame()
      try:
        wire.check_dtypes(header["keys"], blobs)
      except ValueError as e:
        raise wire.Refused(str(e), "dtype") from None
      self._on_replica(sender, step, header, blobs)
      self._steps.known(sender, step)
      conn.send({"kind": wire.ACK, "step": step, "from": self._me.index})
      return
    if kind == wire.DONE:
      self._steps.check(kind, sender, step)
      conn.end_frame()
      self._on_done(sender, step)
      self._steps.known(sender, step)
      return
    expected = self._awaited.start((kind, step, sender))
    if expected is None:
      raise wire.Refused(f"an unexpected {kind} of step {step} from worker {sender}", "unexpected")
    try:
      if kind == wire.COPY:
        offer = self._incoming(step, header["manifest"], sizes)
        self._check_space(sum(sizes))
        offer.receive(conn)  # Its bytes feed the frame's MAC, checked before it counts.
        conn.end_frame()
        expected.finish((header, offer))
      else:
        if sum(sizes) > MAX_PER_WORKER_BYTES:
          raise wire.Refused(f"a per-worker state of {sum(sizes)} bytes", "size")
        blobs = conn.read_blobs(sizes)
        conn.end_frame()
        expected.finish((header, blobs))
    except BaseException as e:
      expected.finish(error=e)
      raise

  def expect(self, kind: str, step: int, sender: int) -> tuple:
    """Registers a message a restore waits for (before the agreement that lets the sender send)."""
    return self._awaited.expect(kind, step, sender)

  def forget(self, key: tuple) -> None:
    """Unregisters a message `expect` registered and nobody will send."""
    self._awaited.forget(key)

  def wait(self, key: tuple, start_timeout: float = awaited_lib.START_S):
    """The message `expect` registered: (header, the received offer) of a copy, (header, blobs) else.

    A sender that does not start within `start_timeout`, or that stops
    sending for STALL_S, has failed (TimeoutError, OSError, wire.Refused).
    """
    return self._awaited.wait(key, start_timeout)

  # -- sending (tfdp.checkpoint.local.outbound) --

  def _connect(self, to: int) -> channel_lib.Channel:
    """An authenticated connection to worker `to` (tests open their own)."""
    return self._sends.connect(to)

  def send_copy(self, to: int, step: int, manifest_json: str, path: str, size: int) -> None:
    """Sends a local copy (its record, then `size` bytes of its slot `path`) to worker `to` (a restore)."""
    self._sends.send_copy(to, step, manifest_json, path, size)

  def send_state(self, to: int, step: int, keys, token: str, blobs) -> None:
    """Sends worker `to` its own per-worker state at `step`, which this worker kept (a restore)."""
    self._sends.send_state(to, step, keys, token, blobs)

  def replicate(self, step: int, tensors: dict, token: str) -> bool:
    """Sends this worker's per-worker state at `step` to its neighbour (the writer thread calls it).

    Returns:
      Whether the neighbour acknowledged it. One that cannot be reached is
      logged once and tried again later; training never waits for it.
    """
    return self._sends.replicate(self.neighbour, step, tensors, token)

  def report_done(self, step: int, skip=()) -> None:
    """Tells every other worker (but `skip`) that this worker's part of `step` is done."""
    self._sends.report_done(step, skip)

  def _warn_once(self, key, msg, *args):
    if key not in self._warned:
      self._warned.add(key)
      logging.warning(msg, *args)

  def close(self) -> None:
    """Ends the listener, its threads and the outgoing connections; a closed link sends nothing."""
    if self._closed:
      return
    self._closed = True
    try:
      self._server.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._server.close()
    if self._accept is not None:
      self._accept.join(timeout=5)
    with self._lock:
      socks = list(self._conns) + self._sends.close()
      threads = list(self._threads)
    for sock in socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      sock.close()
    self._awaited.close()
    for thread in threads:
      thread.join(timeout=5)
    if self.refusals.count:
      logging.warning("tfdp: the local tier's side channel dropped %d connection(s) or "
                      "message(s) that were not of this job or not well formed.",
                      self.refusals.count)

