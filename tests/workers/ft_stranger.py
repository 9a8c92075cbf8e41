"""A stranger on the same host attacking a running job's side channel (no TensorFlow, standard library only).

Usage: ft_stranger.py REPORT CANARY HOST:PORT... Each target gets, on
connections of their own: the per-worker frame of the side channel's old,
unauthenticated protocol (a path-traversal worker id aimed at CANARY, then
a plausible integer one); a handshake answered without the secret (zeros)
and with a wrong secret; an oversized header; then 200 connections at
once. REPORT gets what the server did each time. `insider_frames` sends
malformed frames on a connection authenticated with the job's secret (the
caller, a worker of the job, makes it).
"""

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time

MAGIC = b"tfdp-peer-v3"  # As tfdp.checkpoint.local.wire; copied: this process imports no tfdp.


def _frame(header, blobs=()):
  head = json.dumps(dict(header, sizes=[len(b) for b in blobs])).encode()
  return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def _outcome(sock, wait=1.0):
  """What the server did after our bytes: 'closed' (dropped us), 'answered N bytes', or 'open'."""
  sock.settimeout(wait)
  got = b""
  try:
    while True:
      chunk = sock.recv(4096)
      if not chunk:
        return f"closed after {len(got)} bytes"
      got += chunk
  except socket.timeout:
    return f"open, answered {len(got)} bytes"
  except OSError as e:
    return f"closed ({e.__class__.__name__}) after {len(got)} bytes"


def _attempt(target, send):
  host, port = target.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=5) as sock:
      send(sock)
      return _outcome(sock)
  except OSError as e:
    return f"refused ({e})"


def attacks(target, canary):
  """{attack: what the server did} for one target."""
  traversal = f"0/../../../../../../../../{canary.lstrip('/')}"
  old = {"kind": "per_worker", "from": traversal, "step": 1, "keys": ["data"],
         "token": "x", "world_size": 2}

  def handshake(key):
    def send(sock):
      hello = sock.recv(len(MAGIC) + 4 + 32)
      server, nonce_s = hello[len(MAGIC):len(MAGIC) + 4], hello[len(MAGIC) + 4:]
      nonce_c, index = secrets.token_bytes(32), struct.pack("<I", 0)
      mac = (b"\0" * 32 if key is None else
             hmac.new(key, b"client->server" + MAGIC + server + index + nonce_s + nonce_c,
                      hashlib.sha256).digest())
      sock.sendall(MAGIC + index + nonce_c + mac)
      sock.sendall(_frame(dict(old, **{"from": 0}), [b"\0" * 64]))
    return send

  out = {
      "unauthenticated per-worker frame, traversal id": _attempt(
          target, lambda s: s.sendall(_frame(old, [b"\0" * 64]))),
      "unauthenticated per-worker frame, integer id": _attempt(
          target, lambda s: s.sendall(_frame(dict(old, **{"from": 0}), [b"\0" * 64]))),
      "no secret": _attempt(target, handshake(None)),
      "wrong secret": _attempt(target, handshake(secrets.token_bytes(32))),
      "oversized header": _attempt(
          target, lambda s: s.sendall(struct.pack("<Q", 1 << 40) + b"{" * 65536)),
  }
  host, port = target.rsplit(":", 1)
  flood = []
  for _ in range(200):
    try:
      flood.append(socket.create_connection((host, int(port)), timeout=5))
    except OSError:
      pass
  time.sleep(0.5)
  served = held = 0
  for sock in flood:
    sock.settimeout(0.05)
    got, closed = b"", False
    try:
      while True:
        chunk = sock.recv(4096)
        if not chunk:
          closed = True
          break
        got += chunk
    except socket.timeout:
      pass
    except OSError:
      closed = True
    served += bool(got)
    held += not closed
    sock.close()
  # Each new one evicts the oldest still in its handshake: at most the slots are held.
  out["200 connections at once"] = (f"{len(flood)} connected, {served} got a handshake, "
                                    f"{held} held")
  # The server still serves once the flood is over. It may take a moment to
  # drain its accept queue of the flood's closed connections (each holding a
  # slot until its handler sees the close), so ask again for up to 20 s.
  deadline = time.monotonic() + 20
  while True:
    out["after the flood"] = _attempt(target, lambda s: None)
    if out["after the flood"].startswith("open") or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  return out


def insider_frames(connect, canary):
  """Malformed frames, each on a connection `connect()` returns authenticated: {frame: what the server did}."""
  traversal = f"0/../../../../../../../../{canary.lstrip('/')}"
  good = {"kind": "per_worker", "from": 0, "step": 777777, "keys": ["data"], "token": "x",
          "world_size": 2}
  frames = {
      "traversal id": dict(good, **{"from": traversal}),
      "negative id": dict(good, **{"from": -1}),
      "id out of range": dict(good, **{"from": 5}),
      "string step": dict(good, step="777777"),
      "negative step": dict(good, step=-3),
      "float step": dict(good, step=7.5),
      "bool id": dict(good, **{"from": True}),
      "unknown kind": dict(good, kind="exec"),
      "unknown field": dict(good, path=traversal),
      "wrong world size": dict(good, world_size=3),
      "key list mismatch": dict(good, keys=["a", "b"]),
      "unexpected copy": {"kind": "copy", "from": 0, "step": 777777,
                          "manifest": json.dumps({"prefix": traversal, "files": []})},
      "list-valued kind": dict(good, kind=["per_worker"]),
      "list-valued key": dict(good, keys=[["a"]]),
      "a state at step 10^9": dict(good, step=10 ** 9),
      "done at 2^53-1": {"kind": "done", "from": 0, "step": 2 ** 53 - 1},
  }
  blobs = {"unexpected copy": [b"x", b"y"], "done at 2^53-1": [],
           # A valid float32 scalar (tf.io.serialize_tensor(1.0)): only its step is wrong.
           "a state at step 10^9": [b'\x08\x01\x12\x00"\x04\x00\x00\x80?'],
           # A TensorProto of dtype DT_VARIANT (field 1 = 21), at an old step.
           "a variant dtype": [b"\x08\x15"]}
  frames["a variant dtype"] = dict(good, step=1)
  out = {}
  for name, header in frames.items():
    with connect() as sock:
      _send(sock, json.dumps(dict(header, sizes=[len(b) for b in blobs.get(name, [b"\0" * 64])])
                             ).encode(), blobs.get(name, [b"\0" * 64]))
      out[name] = _outcome(sock)
  with connect() as sock:
    sock.sendall(struct.pack("<Q", 1 << 40))
    out["oversized header"] = _outcome(sock)
  with connect() as sock:
    _send(sock, b"\xff\xfe{[\x00")
    out["not JSON"] = _outcome(sock)
  with connect() as sock:
    _send(sock, b"[" * 200_000 + b"]" * 200_000)
    out["a 200,000-deep header"] = _outcome(sock)
  with connect() as sock:  # 1 GiB announced, none sent: nothing may be allocated for it.
    head = json.dumps(dict(good, step=1, sizes=[1 << 30])).encode()
    _send(sock, head)  # The header and its MAC; the blob's bytes never come.
    out["a 1 GiB announced blob with no data"] = _outcome(sock)
  return out


def _send(sock, head, blobs=()):
  """A frame with header bytes `head`: MAC'd on a tfdp Channel (a worker's), plain on a socket."""
  try:
    if hasattr(sock, "send_raw"):
      sock.send_raw(head, blobs)
    else:
      sock.sendall(struct.pack("<Q", len(head)) + head + b"".join(blobs))
  except OSError:
    pass  # The server closed on the header: _outcome says so.


class Trickle:
  """A stranger holding every slot of some side channels: each connection sends a byte a second, forever.

  A connection the server closes is opened again at once; `longest` is
  the longest any one stayed open (the server cut it, or it is still open),
  `opened` how many were opened in all, `seconds` how long it held them.

  Args:
    targets: (host, port) of each side channel.
    per_port: connections held on each.
  """

  def __init__(self, targets, per_port):
    self._targets, self._per_port = [tuple(t) for t in targets], per_port
    self._stop = threading.Event()
    self.longest, self.opened, self.seconds = 0.0, 0, 0.0
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _open(self, target):
    try:
      sock = socket.create_connection(target, timeout=5)
    except OSError:  # The job ended (its server is closed): nothing to hold.
      return None, time.monotonic()
    self.opened += 1
    return sock, time.monotonic()

  def _run(self):
    start = time.monotonic()
    conns = [self._open(t) for t in self._targets for _ in range(self._per_port)]
    while not self._stop.wait(0.25):
      for i, (sock, since) in enumerate(conns):
        if sock is None:
          conns[i] = self._open(self._targets[i // self._per_port])
          continue
        alive = True
        try:
          sock.setblocking(False)
          try:
            while sock.recv(4096):  # The server's hello, or its close.
              pass
            alive = False
          except BlockingIOError:
            pass
          if alive and time.monotonic() - since >= 1:
            sock.sendall(b"t")
        except OSError:
          alive = False
        if not alive:
          self.longest = max(self.longest, time.monotonic() - since)
          sock.close()
          conns[i] = self._open(self._targets[i // self._per_port])
    now = time.monotonic()
    self.seconds = now - start
    for sock, since in conns:
      if sock is not None:
        self.longest = max(self.longest, now - since)
        sock.close()

  def stop(self):
    self._stop.set()
    self._thread.join(10)


def main(report, canary, *targets):
  with open(report, "w", encoding="utf-8") as f:
    json.dump({t: attacks(t, canary) for t in targets}, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
