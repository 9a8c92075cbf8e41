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
import time

from absl import logging

from tfdp.checkpoint.local import channel as channel_lib
from tfdp.checkpoint import faults
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.local import wire

_CONNECT_TIMEOUT_S = 5.0
_ACK_TIMEOUT_S = 10.0  # A neighbour that does not acknowledge a per-worker state by then is down.
_RETRY_S = 10.0  # After a failed send, that worker is tried again this much later.
START_S = 20.0  # A restore's sender must start sending within this, after the agreement.
STALL_S = 10.0  # A transfer that moves no byte for this long has failed (a dead host).
# With 2 ** 36 (64 GiB) a per-worker state is absurd: a header asking more is dropped.
MAX_PER_WORKER_BYTES = 1 << 36
TRANSFER_FAULT = "during_transfer"  # A fault point: half of a copy's bytes are sent.
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


class _Refusals:
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


class _Closed(ConnectionError):
  """The other end closed the connection cleanly (it closed its side channel)."""


class _Expected:
  """One message a restore waits for: from whom, and what arrived (or why not)."""

  def __init__(self):
    self.started = threading.Event()
    self.done = threading.Event()
    self.result = None
    self.error = None

  def finish(self, result=None, error=None):
    self.result, self.error = result, error
    self.done.set()


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
    self._peers = []
    self._lock = threading.Lock()
    self._conns, self._threads = set(), set()
    self._door = channel_lib.Door(max_connections(me.count), PER_PEER_CONNECTIONS)
    self._expected = {}  # (kind, step, sender) -> _Expected
    self._out = {}  # worker -> authenticated socket (per-worker states, done)
    self._down_until = {}
    self._inbound = {}  # worker -> its connections open now that carried its reports
    self.gone = set()  # Workers whose every such connection ended (they report no more).
    self.refusals = _Refusals()
    self._warned = set()
    self._closed = False
    self._accept = None

  def start(self, peers) -> None:
    """Serves, knowing every worker's (host, port) by index."""
    self._peers = [tuple(p) for p in peers]
    self._accept = threading.Thread(target=self._serve, name="tfdp-peer-server", daemon=True)
    self._accept.start()

  @property
  def address(self) -> str:
    return f"{self._host}:{self.port}"

  @property
  def open(self) -> bool:
    return bool(self._peers) and not self._closed

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
    with self._lock:
      expected = self._expected.get((kind, step, sender))
      if expected is not None and expected.started.is_set():
        expected = None
      if expected is not None:
        expected.started.set()
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
    key = (kind, step, sender)
    with self._lock:
      self._expected[key] = _Expected()
    return key

  def forget(self, key: tuple) -> None:
    """Unregisters a message `expect` registered and nobody will send."""
    with self._lock:
      self._expected.pop(key, None)

  def wait(self, key: tuple, start_timeout: float = START_S):
    """The message registered by `expect`: (header, the received offer) of a copy, (header, blobs) else.

    A sender that does not start within `start_timeout`, or that stops
    sending for STALL_S, has failed: a dead holder is seen in seconds.

    Raises:
      TimeoutError, OSError, wire.Refused: it did not arrive whole.
    """
    with self._lock:
      expected = self._expected[key]
    kind, step, sender = key
    try:
      if not expected.started.wait(start_timeout):
        raise TimeoutError(f"worker {sender} did not start sending the {kind} of step {step} "
                           f"within {start_timeout:.0f}s")
      while not expected.done.wait(1.0):
        if self._closed:
          raise ConnectionError("the side channel was closed")
      if expected.error is not None:
        raise expected.error
      return expected.result
    finally:
      self.forget(key)

  # -- sending --

  def _connect(self, to: int) -> channel_lib.Channel:
    """An authenticated connection to worker `to` (a Channel: its frames carry MACs)."""
    sock = socket.create_connection(self._peers[to], timeout=_CONNECT_TIMEOUT_S)
    try:
      return channel_lib.client_handshake(sock, self._secret, self._me.index, to)
    except BaseException:
      sock.close()
      raise

  def send_copy(self, to: int, step: int, manifest_json: str, path: str, size: int) -> None:
    """Sends a local copy (its record, then `size` bytes of its slot `path`) to worker `to` (a restore)."""
    header = {"kind": wire.COPY, "step": step, "from": self._me.index, "manifest": manifest_json}
    with self._connect(to) as sock:
      sock.settimeout(STALL_S)
      sock.send_file(header, path, size,
                     halfway=lambda: faults.reached(TRANSFER_FAULT, self._me.index))

  def send_state(self, to: int, step: int, keys, token: str, blobs) -> None:
    """Sends worker `to` its own per-worker state at `step`, which this worker kept (a restore)."""
    header = {"kind": wire.PER_WORKER_COPY, "step": step, "from": self._me.index,
              "keys": list(keys), "token": token}
    with self._connect(to) as sock:
      sock.settimeout(STALL_S)
      sock.send(header, blobs)

  def _outbound(self, to):
    with self._lock:
      sock = self._out.get(to)
    if sock is None:
      sock = self._connect(to)
      with self._lock:
        self._out[to] = sock
    return sock

  def _failed(self, to, what, e):
    self._down_until[to] = time.monotonic() + _RETRY_S
    with self._lock:
      sock = self._out.pop(to, None)
    if sock is not None:
      sock.close()
    if isinstance(e, _Closed):  # It finished (or stopped) and closed its side channel.
      logging.info("tfdp: worker %d closed its side channel; %s not sent.", to, what)
      return
    self._warn_once(("send", to), "tfdp: cannot send %s to worker %d (%s); a replaced host "
                    "then restarts from the newest step complete on every worker.", what, to, e)

  def replicate(self, step: int, tensors: dict, token: str) -> bool:
    """Sends this worker's per-worker state at `step` to its neighbour (the writer thread calls it).

    Returns:
      Whether the neighbour acknowledged it. One that cannot be reached is
      logged once and tried again later; training never waits for it.
    """
    to = self.neighbour
    if self._closed or time.monotonic() < self._down_until.get(to, 0.0):
      return False
    self._steps.sent(step)
    description, blobs = wire.tensors_to_wire(tensors)
    header = {"kind": wire.PER_WORKER, "step": step, "from": self._me.index,
              "keys": description["keys"], "token": token, "world_size": self._me.count}
    try:
      sock = self._outbound(to)
      sock.settimeout(_ACK_TIMEOUT_S)
      sock.send(header, blobs)
      ack = sock.read_header()
      if ack is None:
        raise _Closed("the neighbour closed the connection")
      wire.check_header(ack, to, self._me.count)
      sock.end_frame()
      if ack["kind"] != wire.ACK or ack["step"] != step:
        raise ConnectionError(f"expected the ack of step {step}, got {ack['kind']}")
      return True
    except (OSError, wire.Refused) as e:
      self._failed(to, "the per-worker state", e)
      return False

  def report_done(self, step: int, skip=()) -> None:
    """Tells every other worker (but `skip`) that this worker's part of `step` is done."""
    self._steps.sent(step)
    for to in range(self._me.count):
      if (to == self._me.index or to in skip or self._closed
          or time.monotonic() < self._down_until.get(to, 0.0)):
        continue
      try:
        self._outbound(to).send({"kind": wire.DONE, "step": step, "from": self._me.index})
      except OSError as e:
        self._failed(to, "that a step is done", e)

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
      socks = list(self._conns) + list(self._out.values())
      self._out.clear()
      threads = list(self._threads)
      expected = list(self._expected.values())
    for sock in socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      sock.close()
    for e in expected:
      e.finish(error=ConnectionError("the side channel was closed"))
    for thread in threads:
      thread.join(timeout=5)
    if self.refusals.count:
      logging.warning("tfdp: the local tier's side channel dropped %d connection(s) or "
                      "message(s) that were not of this job or not well formed.",
                      self.refusals.count)

