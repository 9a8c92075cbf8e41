"""The local tier's side channel admits only its own job: a stranger's connections and malformed frames are dropped.

In-process: two workers' local tiers joined by real sockets
(tier_runs.linked_tiers) and a stranger with the standard library only
(tests/workers/ft_stranger.py). Slow: the same stranger against a running
2-worker plain-fit job (tier_runs.replaced_host_job), which then ends
bitwise equal to an uninterrupted run (tests/test_recovery.py checks that).
"""

import concurrent.futures
import contextlib
import json
import os
import re
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from tests import tier_runs
from tests.conftest import WORKERS
from tests.conftest import launch_workers
from tests.test_fit_data_position import two_worker_reference_runs  # pylint: disable=unused-import
from tests.tier_runs import replaced_host_job  # pylint: disable=unused-import
from tfdp.checkpoint.local import channel
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import slot_file
from tfdp.checkpoint.format.planner import Item
from tfdp.checkpoint.local import peers
from tfdp.checkpoint.local import slots
from tfdp.checkpoint.local import wire

sys.path.insert(0, WORKERS)
import ft_stranger  # pylint: disable=g-import-not-at-top,wrong-import-position

HELLO = channel.HELLO_BYTES  # What the server says before it knows who connects.


def _files(folder):
  return sorted(os.path.relpath(os.path.join(d, f), folder)
                for d, _, names in os.walk(folder) for f in names)


@pytest.fixture
def tiers(tmp_path):
  with tier_runs.linked(str(tmp_path / "local")) as tiers:
    yield tiers


def _assert_dropped(report, what):
  for attack, outcome in report.items():
    if attack in ("200 connections at once", "after the flood"):
      continue
    # The server's hello at most: it never proved itself, never read a frame.
    got = int(outcome.rsplit(" after ", 1)[1].split()[0]) if " after " in outcome else None
    assert outcome.startswith("closed") and got is not None and got <= HELLO, (what, attack, outcome)


def _assert_stranger_failed(report, canary):
  assert not os.path.exists(canary), "a file was written outside the local tier"
  for target, attacks in report.items():
    _assert_dropped(attacks, target)
    connected, _, held = (int(w) for w in re.findall(r"\d+", attacks["200 connections at once"]))
    assert connected == 200 and held <= peers.max_connections(2), attacks
    assert attacks["after the flood"] == f"open, answered {HELLO} bytes", attacks  # still serving


def _rss():
  with open("/proc/self/statm", encoding="ascii") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _assert_insider_dropped(insider):
  for name, outcome in insider.items():
    # A blob announced but never sent is waited for (its memory grows only with what
    # arrives) until the sender stops: then refused like the others.
    ok = ("closed", "open, answered 0") if name.startswith("a 1 GiB") else ("closed",)
    assert outcome.startswith(ok), (name, outcome)


def test_a_stranger_on_the_host_is_dropped_and_nothing_is_written(tiers, tmp_path):
  """No secret, a wrong one, the old unauthenticated frame, traversal ids, an oversized header, 200 at once."""
  canary = str(tmp_path / "escaped")
  tier_runs.save_local(tiers[1], 2)  # Worker 0 keeps worker 1's data position of step 2.
  before = [_files(t.layout.directory) for t in tiers]
  targets = [f"localhost:{t.link.port}" for t in tiers]
  # Each server is attacked on its own; the attacks mostly wait for its answers.
  with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
    report = dict(zip(targets, pool.map(lambda t: ft_stranger.attacks(t, canary), targets)))
  _assert_stranger_failed(report, canary)
  # A worker of the job sending malformed frames (the secret, but bad fields, a 200,000-deep
  # header, 1 GiB announced and never sent, steps 10^9 and 2^53-1, a variant): each dropped
  # and counted once, no thread of the server lost, no memory taken for what never came.
  refused, rss = tiers[1].link.refusals.count, _rss()
  insider = ft_stranger.insider_frames(lambda: tiers[0].link._connect(1), canary)  # pylint: disable=protected-access
  _assert_insider_dropped(insider)
  deadline = time.monotonic() + 10
  while tiers[1].link.refusals.count < refused + len(insider) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert tiers[1].link.refusals.count == refused + len(insider), insider
  assert _rss() - rss < 64 << 20
  assert tiers[1].link._accept.is_alive()  # pylint: disable=protected-access
  assert not os.path.exists(canary)
  assert [_files(t.layout.directory) for t in tiers] == before
  # The job's own traffic goes on: step 4 is complete on both workers.
  for tier in tiers:
    tier_runs.save_local(tier, 4)
  assert 4 in tiers[0].kept_for_left() and 4 in tiers[1].kept_for_left()
  assert tiers[0].generations.floor == 4 and tiers[1].generations.floor == 4


def _impostor():
  """A server on this host that speaks the protocol but does not know the secret; returns its port."""
  server = socket.create_server(("localhost", 0))

  def serve():
    conn, _ = server.accept()
    with conn:
      conn.sendall(channel.MAGIC + struct.pack("<I", 1) + os.urandom(32))
      wire.recv_exact(conn, channel.ANSWER_BYTES)
      conn.sendall(os.urandom(32))  # A "proof" made without the key.
      conn.recv(1)
    server.close()

  threading.Thread(target=serve, daemon=True).start()
  return server.getsockname()[1]


def test_a_worker_proves_the_secret_and_checks_the_servers_proof(tiers, tmp_path):
  """A client with another key is dropped; a server not of the job (on a dead peer's port) gets nothing."""
  other, _ = tier_runs.linked_tiers(str(tmp_path / "other"))
  try:
    stranger = other[0].link
    stranger._sends.peers = tiers[0].link._sends.peers  # pylint: disable=protected-access
    with pytest.raises(ConnectionError):  # tiers[1] drops it before its proof.
      stranger._connect(1)  # pylint: disable=protected-access
  finally:
    for tier in other:
      tier.close()
  tiers[0].link._sends.peers[1] = ("localhost", _impostor())  # pylint: disable=protected-access
  with pytest.raises(ConnectionError, match="not a worker of this job"):
    tiers[0].link._connect(1)  # pylint: disable=protected-access
  tier_runs.save_local(tiers[0], 2)  # Its state is not sent to the impostor: not kept anywhere.
  assert tiers[1].kept_for_left() == [] and tiers[0].generations.floor is None


def test_the_side_channel_listens_on_this_workers_own_address_only(tiers):
  host, _ = tiers[0].link._server.getsockname()[:2]  # pylint: disable=protected-access
  assert host == socket.gethostbyname("localhost")
  assert peers.own_host("10.0.0.2:2222") == "10.0.0.2" and peers.own_host("[::1]:5") == "::1"


_GOOD = {"kind": "per_worker", "from": 0, "step": 12, "sizes": [3], "keys": ["data"],
         "token": "t", "world_size": 2}


@pytest.mark.parametrize("change", [
    {"kind": "exec"}, {"kind": None}, {"from": "0/../../x"}, {"from": -1}, {"from": 2},
    {"from": 1}, {"from": True}, {"from": 0.0}, {"step": -1}, {"step": "12"}, {"step": 1.5},
    {"step": 2 ** 60}, {"step": None}, {"sizes": [-1]}, {"sizes": "3"}, {"sizes": [3] * 5000},
    {"keys": ["a", "b"]}, {"keys": [""]}, {"keys": [7]}, {"keys": ["k" * 5000]},
    {"token": 5}, {"world_size": 3}, {"world_size": "2"}, {"path": "/etc/passwd"},
])
def test_every_header_field_is_checked(change):
  header = dict(_GOOD, **change)
  if change.get("kind") is None and "kind" in change:
    del header["kind"]
  with pytest.raises(wire.Refused):
    wire.check_header(header, sender=0, num_workers=2)


def test_headers_that_are_right_pass():
  wire.check_header(dict(_GOOD), sender=0, num_workers=2)
  wire.check_header({"kind": "done", "from": 1, "step": 0, "sizes": []}, sender=1, num_workers=2)
  with pytest.raises(wire.Refused, match="carries data"):
    wire.check_header({"kind": "done", "from": 1, "step": 0, "sizes": [1]}, 1, 2)


def test_a_copy_offered_at_a_restore_is_checked_and_lands_only_where_the_layout_says(tmp_path):
  layout = layout_lib.Layout(str(tmp_path / "worker-1"), "ckpt")
  slot = slots.Slot(layout.slot(1))
  entry = ["v", "float32", [5], 0, 20, 7]
  man = {"prefix": "ckpt-7", "step": 7, "checkpoint_number": 7, "tier": "local",
         "files": [{"name": "ckpt.slot-0", "size": 20, "entries": [entry]}]}
  got = copies.incoming(layout, slot, 7, json.dumps(man), [20])
  assert got.manifest.step == 7 and got.slot.path == layout.slot(1) and got.size == 20
  bad_entries = [[["v", "float32", [6], 0, 20, 7]], [["v", "resource", [5], 0, 20, 7]],
                 [["../../x", "float32", [5], 0, 20, 7], ["../../x", "int8", [0], 20, 0, 0]],
                 [["v", "float32", [5], -4, 20, 7]], [["v", "float32", [5], 4, 20, 7]],
                 [["v", "float32", [5], 0, 20, 2 ** 40]], "x", [[1, 2]]]
  for bad in [dict(man, prefix="../../ckpt-7"), dict(man, step=8), dict(man, tier="persistent"),
              dict(man, files=[]), dict(man, files="x"), "not a manifest",
              dict(man, files=[man["files"][0], man["files"][0]])] + [
                  dict(man, files=[dict(man["files"][0], entries=e)]) for e in bad_entries]:
    with pytest.raises(wire.Refused):
      copies.incoming(layout, slot, 7, json.dumps(bad), [20])
  with pytest.raises(wire.Refused):  # Sizes that do not match the manifest.
    copies.incoming(layout, slot, 7, json.dumps(man), [2 ** 40])
  assert not os.path.exists(layout.slot(1))  # Nothing was written.


def test_a_restore_accepts_only_the_message_it_waits_for(tiers):
  """A copy nobody asked for is dropped; the one expected, from the worker expected, arrives."""
  tier_runs.save_local(tiers[0], 6)
  (held,) = tiers[0].held()
  link0, link1 = tiers[0].link, tiers[1].link
  try:  # Not expected: dropped.
    link0.send_copy(1, 6, held.manifest.to_json(), *tiers[0].send_of(held))
  except OSError:
    pass  # The server closed the connection before it got all of it.
  # Dropped before anything is expected: the server reads a connection after
  # the sender returns, so it would otherwise count as the expected one.
  deadline = time.monotonic() + 10
  while link1.refusals.count < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert link1.refusals.count == 1
  key = link1.expect(wire.COPY, 6, 0)
  sender = threading.Thread(target=link0.send_copy,
                            args=(1, 6, held.manifest.to_json(), *tiers[0].send_of(held)))
  sender.start()
  _, offered = link1.wait(key)
  sender.join()
  assert offered.manifest.step == 6 and os.path.exists(offered.slot.path)
  assert link1.refusals.count == 1
  with pytest.raises(TimeoutError, match="did not start sending"):
    link1.wait(link1.expect(wire.COPY, 8, 0), start_timeout=0.2)


@pytest.mark.slow
def test_a_stranger_against_a_running_jobs_side_channel_gets_nothing_in(replaced_host_job):
  """Attempt 0 of the replaced-host job: worker 0 starts the stranger (another process) at step 3."""
  root, out = replaced_host_job["root"], replaced_host_job["out"]
  with open(os.path.join(root, "attack", "stranger.json"), encoding="utf-8") as f:
    stranger = json.load(f)
  assert len(stranger) == 2  # Both workers' side channels.
  _assert_stranger_failed(stranger, os.path.join(root, "escaped"))
  with open(os.path.join(root, "attack", "insider.json"), encoding="utf-8") as f:
    insider = json.load(f)
  assert insider, insider
  _assert_insider_dropped(insider)
  with open(os.path.join(root, "attack", "check.json"), encoding="utf-8") as f:
    check = json.load(f)  # Worker 1's tier right after the attacks.
  allowed = {f"ckpt-{s}.manifest.json" for s in range(check["step"] + 1)}
  allowed |= {f"peer-0/ckpt-{s}" for s in range(check["step"] + 1)} | {"ckpt.slot-0", "ckpt.slot-1"}
  assert set(check["files"]) <= allowed, check
  assert check["refused"] >= len(insider) + 5 and check["threads"] < 20, check
  # Each kind of problem is logged once per worker, not once per connection.
  for line in ("failed authentication: not a worker of this job", "connections at once"):
    assert out.count(line) <= 2, (line, out.count(line))


def _bounce(link, fake_index=None):
  """A process without the secret on worker 1's (dead) port: bounces worker 0's own hello back to it.

  It connects to worker 0's server as a client, hands worker 0's hello
  (with the server's index rewritten to `fake_index`, when given) to worker
  0's client that came to it, and relays the client's answer to worker 0's
  server. Returns (its port, {what each side did}).
  """
  server = socket.create_server(("localhost", 0))
  seen = {}

  def serve():
    victim, _ = server.accept()
    with victim, socket.create_connection(link._sends.peers[0]) as back:  # pylint: disable=protected-access
      hello = bytearray(wire.recv_exact(back, channel.HELLO_BYTES))
      if fake_index is not None:
        hello[len(channel.MAGIC):len(channel.MAGIC) + 4] = struct.pack("<I", fake_index)
      victim.sendall(hello)
      victim.settimeout(2)
      try:
        answer = bytes(wire.recv_exact(victim, channel.ANSWER_BYTES))
      except OSError as e:
        seen["client"] = f"no answer ({e.__class__.__name__})"
        return
      seen["client"] = "answered"
      back.sendall(answer)
      back.settimeout(2)
      proof = back.recv(64)
      seen["server"] = f"proof of {len(proof)} bytes"
      victim.sendall(proof)
      victim.sendall(b"\0" * 64)  # A forged ACK/DONE, if it got this far.
    server.close()

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  return server.getsockname()[1], seen, thread


@pytest.mark.parametrize("fake_index", [None, 1])
def test_a_workers_own_hello_reflected_back_to_it_is_refused(tiers, fake_index):
  """Nothing sent, nothing accepted, no step voided: the job's next save is complete everywhere."""
  link = tiers[0].link
  real = link._sends.peers[1]  # pylint: disable=protected-access
  port, seen, thread = _bounce(link, fake_index)
  link._sends.peers[1] = ("localhost", port)  # pylint: disable=protected-access
  refused = link.refusals.count
  tier_runs.save_local(tiers[0], 2)  # Its state and its DONE go to the impostor.
  thread.join(10)
  if fake_index is None:  # The hello names worker 0, not the worker 1 it called.
    assert seen["client"].startswith("no answer") and "server" not in seen, seen
  else:  # Its answer names server 1: worker 0's server (index 0) refuses it, proves nothing.
    assert seen == {"client": "answered", "server": "proof of 0 bytes"}, seen
    assert link.refusals.count == refused + 1
  assert tiers[1].kept_for_left() == [] and tiers[0].generations.floor is None
  link._sends.peers[1] = real  # pylint: disable=protected-access
  link._sends._down_until.clear()  # pylint: disable=protected-access
  for tier in tiers:
    tier_runs.save_local(tier, 4)
  assert tiers[0].generations.floor == 4 and tiers[1].generations.floor == 4


def test_a_server_refuses_a_client_claiming_its_own_index(tiers):
  """Even with the job's secret: worker 0 cannot be its own client (a reflected handshake)."""
  link = tiers[0].link
  with socket.create_connection(link._sends.peers[0]) as sock:  # pylint: disable=protected-access
    with pytest.raises(ConnectionError):
      channel.client_handshake(sock, link._secret, 0, 0)  # pylint: disable=protected-access
  time.sleep(0.2)
  assert link.refusals.count == 1


def test_a_frame_spliced_from_another_connection_or_replayed_is_refused_by_its_mac(tiers):
  link = tiers[0].link
  first, second = link._connect(1), link._connect(1)  # pylint: disable=protected-access
  try:
    a, b = socket.socketpair()
    real, first.sock = first.sock, a
    first.send({"kind": wire.DONE, "step": 2, "from": 0})  # Recorded, not sent.
    recorded = b.recv(1 << 16)
    first.sock = real
    a.close(), b.close()
    refused = tiers[1].link.refusals.count
    second.sendall(recorded)  # Spliced into another connection of the same two workers.
    assert ft_stranger._outcome(second).startswith("closed")  # pylint: disable=protected-access
    assert tiers[1].link.refusals.count == refused + 1
    first.sendall(recorded + recorded)  # Its own connection: once, then replayed.
    assert ft_stranger._outcome(first).startswith("closed")  # pylint: disable=protected-access
    assert tiers[1].link.refusals.count == refused + 2
    assert tiers[1].generations.floor is None
  finally:
    first.close()
    second.close()


def test_trickling_strangers_holding_every_slot_keep_no_worker_out(tiers):
  """Every slot of both servers held, over and over: the workers still connect, replicate and complete."""
  trickle = ft_stranger.Trickle([("localhost", t.link.port) for t in tiers],
                               peers.max_connections(2))
  try:
    time.sleep(1.0)  # Every slot is the stranger's now.
    for step in (2, 4):
      for tier in tiers:  # New connections each time (as after a worker's restart).
        for sock in list(tier.link._sends._out.values()):  # pylint: disable=protected-access
          sock.close()
        tier.link._sends._out.clear()  # pylint: disable=protected-access
      for tier in tiers:
        tier_runs.save_local(tier, step)
      assert tiers[0].kept_for_left()[-1] == step and tiers[1].kept_for_left()[-1] == step
      assert tiers[0].generations.floor == step and tiers[1].generations.floor == step
      time.sleep(channel.HANDSHAKE_S + 0.5)
  finally:
    trickle.stop()
  # No stranger held a slot past the handshake's deadline (its eviction by a worker came sooner).
  assert trickle.longest < channel.HANDSHAKE_S + 1.0, trickle.longest
  assert trickle.opened > 2 * peers.max_connections(2) * 2


@pytest.mark.slow
def test_a_job_under_strangers_holding_every_slot_replicates_and_ends_bitwise_equal(
    tmp_path, two_worker_reference_runs):  # pylint: disable=redefined-outer-name
  """tests/workers/ft_trickle.py: ft_fit's plain fit while a stranger holds every slot of both workers.

  Every connection between the workers is made while the slots are held:
  they connect, replicate and complete their steps, no stranger keeps a
  slot past the handshake's deadline, and the run ends bitwise equal to the
  uninterrupted one (the reference test_recovery compares with too).
  """
  code, out = launch_workers(
      [sys.executable, os.path.join(WORKERS, "ft_trickle.py"), str(tmp_path)],
      env={"FT_LOCAL_EVERY": str(tier_runs.LOCAL_EVERY), "FT_SAVE_FREQ": "100"})
  assert code == 0, out[-5000:]
  reports = {int(m.group(1)): json.loads(m.group(2))
             for m in tier_runs.lines(out, r"worker (\d): trickled: (\{.*\})")}
  assert sorted(reports) == [0, 1], out[-5000:]
  for report in reports.values():
    assert report["kept"] and report["floor"] is not None, reports
    assert report["floor"] >= max(report["kept"]) - 2 * tier_runs.LOCAL_EVERY, reports
    assert report["refused"] > 0, reports  # The stranger's connections, cut.
  assert reports[0]["opened"] > 2 * peers.max_connections(2), reports  # Some cut, opened again.
  assert reports[0]["longest"] < channel.HANDSHAKE_S + 1.5, reports
  ref = tier_runs.weights(two_worker_reference_runs["root"] + "/ref", 0)
  for worker in (0, 1):
    np.testing.assert_array_equal(ref, tier_runs.weights(str(tmp_path), worker))


def test_a_header_of_unterminated_escaped_quotes_is_refused_in_one_pass():
  """Its depth check ran a regex whose time grew with the square of the header (~11 min here)."""
  raw = b'"' + b'\\"' * 200_000
  start = time.perf_counter()
  with pytest.raises(wire.Refused):
    wire.parse_header(raw)
  assert time.perf_counter() - start < 2.0
  assert wire.parse_header(b'{"a": "[[{\\"}", "b": [1, {"c": 2}]}') == {"a": '[[{"}', "b": [1, {"c": 2}]}



def _channels():
  """Two ends of one connection (a socketpair), each a Channel under the other's keys."""
  a, b = socket.socketpair()
  keys = (b"k" * 32, b"q" * 32)
  return (channel.Channel(a, send_key=keys[0], recv_key=keys[1]),
          channel.Channel(b, send_key=keys[1], recv_key=keys[0]))


class _AlteringSocket:
  """The sender's real socket, whose sendfile alters the byte at `at` of the file on the wire."""

  def __init__(self, sock, at):
    self._sock, self._at = sock, at

  def __getattr__(self, name):
    return getattr(self._sock, name)

  def sendfile(self, file, offset=0, count=None):
    data = bytearray(os.pread(file.fileno(), count, offset))
    if offset <= self._at < offset + len(data):
      data[self._at - offset] ^= 0x10
    self._sock.sendall(data)
    return len(data)


def _copy_of(tmp_path, entries, used):
  """(the receiver's layout, the header of a COPY frame of step 7 whose slot holds `entries`)."""
  layout = layout_lib.Layout(str(tmp_path / "receiver"), "ckpt")
  os.makedirs(layout.directory)
  man = {"prefix": "ckpt-7", "step": 7, "checkpoint_number": 7, "tier": "local",
         "files": [{"name": "ckpt.slot-0", "size": used,
                    "entries": [[e.key, e.dtype, e.shape, e.offset, e.size, e.crc32c]
                                for e in entries]}]}
  return layout, {"kind": wire.COPY, "step": 7, "from": 0, "manifest": json.dumps(man)}


def test_a_copy_is_checked_as_it_lands_and_its_mac_covers_every_byte_in_flight(tmp_path):
  """A copy's bytes land in a slot while another thread checks them: its CRC32Cs and the frame's MAC.

  A byte altered in a tensor is refused by its CRC32C; one altered between
  two tensors (the alignment no CRC32C covers) by the MAC, fed every byte
  by the checking thread; the bytes as sent land and pass both.
  """
  holder = slots.Slot(str(tmp_path / "holder" / "ckpt.slot-0"))
  os.makedirs(os.path.dirname(holder.path))
  values = {"a": np.arange(3, dtype=np.float32),  # 12 bytes, then a gap to the next 64.
            "b": np.arange(3 << 20, dtype=np.float32)}  # 12 MB: several pieces of the check.
  entries, used = holder.fill([Item(k, "", v, None) for k, v in values.items()])
  gap = next(e.offset + e.size for e in entries if e.key == "a")
  inside = next(e.offset for e in entries if e.key == "b") + (7 << 20) + 5
  assert gap < next(e.offset for e in entries if e.key == "b")
  layout, header = _copy_of(tmp_path, entries, used)
  for altered, refused in ((None, None), (inside, "crc"), (gap, "frame MAC")):
    sender, receiver = _channels()
    if altered is not None:
      sender.sock = _AlteringSocket(sender.sock, altered)
    with _offered(layout, header, holder.path, used, sender, receiver) as offer:
      if refused is None:
        offer.receive(receiver)
        receiver.end_frame()
        got = slot_file.read(layout.slot(1), offer.manifest.slot.entries, used)
        assert all(np.array_equal(got[k], v) for k, v in values.items())
        assert set(offer.times.take()) >= {"recv", "land_check", "land_tail"}
      else:
        with pytest.raises(wire.Refused) as e:
          offer.receive(receiver)
          receiver.end_frame()
        assert e.value.key == refused, e.value


@contextlib.contextmanager
def _offered(layout, header, path, used, sender, receiver):
  """The copy in slot file `path` offered by `sender` (a thread sends it) to `receiver`, as slot 1 of `layout`."""
  thread = threading.Thread(target=lambda: sender.send_file(header, path, used), daemon=True)
  thread.start()
  offer = copies.incoming(layout, slots.Slot(layout.slot(1)), 7,
                          receiver.read_header()["manifest"], [used])
  try:
    yield offer
  finally:
    receiver.close()  # A refused copy's sender may still be sending.
    thread.join(timeout=10)
    offer.slot.close()


def _mapped(path: str) -> int:
  """Bytes of file `path` this process has mapped in now (the Rss of its mappings)."""
  total, here = 0, False
  with open("/proc/self/smaps") as f:
    for line in f:
      if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
        here = line.rstrip("\n").endswith(" " + path)
      elif here and line.startswith("Rss:"):
        total += int(line.split()[1]) << 10
  return total


def test_a_received_copy_lands_through_its_slot_file_not_a_fault_per_page_of_its_mapping(tmp_path):
  """The receiver writes a copy's bytes to its slot's file (the page cache takes them), checked as they land.

  Faulting a fresh tmpfs slot's pages into the receiving mapping (each one
  zeroed first) cost the receiver of 1 GB twice the CPU of writing the same
  bytes to the file, and made the whole peer recovery 4-10x a raw transfer
  on busy cores (issue 45, docs/performance.md). Here 96 MB land without
  a page of the slot's mapping touched; the bytes read back are those sent.
  """
  holder = slots.Slot(str(tmp_path / "holder" / "ckpt.slot-0"))
  os.makedirs(os.path.dirname(holder.path))
  value = np.random.default_rng(0).random(12 << 20)  # 96 MB of float64
  entries, used = holder.fill([Item("w", "", value, None)])
  layout, header = _copy_of(tmp_path, entries, used)
  sender, receiver = _channels()
  with _offered(layout, header, holder.path, used, sender, receiver) as offer:
    offer.receive(receiver)
    receiver.end_frame()
    mapped = _mapped(layout.slot(1))  # The slot stays mapped (Slot.receivable) until closed.
  assert mapped < used // 8, (mapped, used)  # Through the mapping: all of it.
  got = slot_file.read(layout.slot(1), offer.manifest.slot.entries, used)
  assert np.array_equal(got["w"], value)


def test_a_frames_blobs_pass_only_under_their_directions_derived_key_and_its_construction():
  """The blobs' MAC is keyed BLAKE3 under a key derived for the blobs of that direction.

  A frame whose blobs carry the old HMAC-SHA256 of (sequence number,
  blobs) under the direction's key, the right construction under the other
  direction's key, under the direction's own (header) key, or under another
  sequence number is refused; the right one passes.
  """
  import hashlib  # pylint: disable=g-import-not-at-top
  import hmac  # pylint: disable=g-import-not-at-top
  keys = (b"k" * 32, b"q" * 32)  # As _channels: the first end sends under keys[0].
  blob = os.urandom(5000)

  def tag(mac):
    mac.update(blob)
    return mac.digest()

  tags = {"right": tag(channel.blobs_mac(channel.blobs_key(keys[0]), 0)),
          "old HMAC-SHA256": tag(hmac.new(keys[0], b"blobs" + wire.LENGTH.pack(0), hashlib.sha256)),
          "other direction": tag(channel.blobs_mac(channel.blobs_key(keys[1]), 0)),
          "header key": tag(channel.blobs_mac(keys[0], 0)),
          "another frame": tag(channel.blobs_mac(channel.blobs_key(keys[0]), 1))}
  assert len(set(tags.values())) == len(tags)
  for name, mac in tags.items():
    sender, receiver = _channels()
    try:
      sender.start_frame(json.dumps({"kind": wire.DONE, "sizes": [len(blob)]}).encode())
      sender.sendall(blob + mac)
      sizes = receiver.read_header()["sizes"]
      assert bytes(receiver.read_blobs(sizes)[0]) == blob
      if name == "right":
        receiver.end_frame()
      else:
        with pytest.raises(wire.Refused) as e:
          receiver.end_frame()
        assert e.value.key == "frame MAC", name
    finally:
      sender.close(), receiver.close()
