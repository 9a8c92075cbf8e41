"""This worker's sends over the side channel: its per-worker state to its neighbour, that a step is done, and a restore's copies and states."""

import socket
import threading
import time

from absl import logging

from tfdp.checkpoint.local import channel as channel_lib
from tfdp.checkpoint.local import wire

_CONNECT_TIMEOUT_S = 5.0
_ACK_TIMEOUT_S = 10.0  # A neighbour that does not acknowledge a per-worker state by then is down.
_RETRY_S = 10.0  # After a failed send, that worker is tried again this much later.
STALL_S = 10.0  # A transfer that moves no byte for this long has failed (a dead host).


class _Closed(ConnectionError):
  """The other end closed the connection cleanly (it closed its side channel)."""


class Outbound:
  """The sending half of tfdp.checkpoint.local.peers.PeerLink: authenticated connections to the other workers.

  A worker that cannot be reached is logged once and left alone for
  _RETRY_S; training never waits for it.

  Args:
    me: this worker (`tfdp.distribute.cluster.Worker`).
    secret: the job's key.
    steps: the link's `wire.StepBound` (told each step sent).
    warn_once: `fn(key, msg, *args)`: the link's warning, once per key.
  """

  def __init__(self, me, secret: bytes, steps: wire.StepBound, warn_once):
    self._me, self._secret, self._steps, self._warn_once = me, secret, steps, warn_once
    self.peers = []  # Every worker's (host, port), by index, once the link starts.
    self._lock = threading.Lock()
    self._out = {}  # worker -> authenticated socket (per-worker states, done)
    self._down_until = {}
    self._closed = False

  def connect(self, to: int) -> channel_lib.Channel:
    """An authenticated connection to worker `to` (a Channel: its frames carry MACs)."""
    sock = socket.create_connection(self.peers[to], timeout=_CONNECT_TIMEOUT_S)
    try:
      return channel_lib.client_handshake(sock, self._secret, self._me.index, to)
    except BaseException:
      sock.close()
      raise

  def send_copy(self, to: int, step: int, manifest_json: str, path: str, size: int) -> None:
    """Sends a local copy (its record, then `size` bytes of its slot `path`) to worker `to` (a restore)."""
    header = {"kind": wire.COPY, "step": step, "from": self._me.index, "manifest": manifest_json}
    with self.connect(to) as sock:
      sock.settimeout(STALL_S)
      sock.send_file(header, path, size)

  def send_state(self, to: int, step: int, keys, token: str, blobs) -> None:
    """Sends worker `to` its own per-worker state at `step`, which this worker kept (a restore)."""
    header = {"kind": wire.PER_WORKER_COPY, "step": step, "from": self._me.index,
              "keys": list(keys), "token": token}
    with self.connect(to) as sock:
      sock.settimeout(STALL_S)
      sock.send(header, blobs)

  def _kept(self, to):
    """The connection to worker `to` that its reports go by (opened once)."""
    with self._lock:
      sock = self._out.get(to)
    if sock is None:
      sock = self.connect(to)
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

  def _down(self, to) -> bool:
    return self._closed or time.monotonic() < self._down_until.get(to, 0.0)

  def replicate(self, to: int, step: int, tensors: dict, token: str) -> bool:
    """Sends this worker's per-worker state at `step` to worker `to`; returns whether it acknowledged it."""
    if self._down(to):
      return False
    self._steps.sent(step)
    description, blobs = wire.tensors_to_wire(tensors)
    header = {"kind": wire.PER_WORKER, "step": step, "from": self._me.index,
              "keys": description["keys"], "token": token, "world_size": self._me.count}
    try:
      sock = self._kept(to)
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
      if to == self._me.index or to in skip or self._down(to):
        continue
      try:
        self._kept(to).send({"kind": wire.DONE, "step": step, "from": self._me.index})
      except OSError as e:
        self._failed(to, "that a step is done", e)

  def close(self) -> list:
    """Sends nothing more; returns the open connections, for the link to shut down."""
    with self._lock:
      self._closed = True
      socks = list(self._out.values())
      self._out.clear()
    return socks
