"""The local tier's side channel admits only its own job: a stranger's connections and malformed frames are dropped.

In-process: two workers' local tiers joined by real sockets
(tier_runs.linked_tiers) and a stranger with the standard library only
(tests/workers/ft_stranger.py). Slow: the same stranger against a running
2-worker plain-fit job (tier_runs.replaced_host_job), which then ends
bitwise equal to an uninterrupted run (tests/test_recovery.py checks that).
"""

import json
import os
import re
import socket
import sys
import threading
import time

import pytest

from tests import tier_runs
from tests.conftest import WORKERS
from tests.tier_runs import replaced_host_job  # pylint: disable=unused-import
from tfdp.checkpoint import copies
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import peers
from tfdp.checkpoint import slots
from tfdp.checkpoint import wire

sys.path.insert(0, WORKERS)
import ft_stranger  # pylint: disable=g-import-not-at-top,wrong-import-position

HELLO = len(wire.MAGIC) + 32  # What the server says before it knows who connects.


def _files(folder):
  return sorted(os.path.relpath(os.path.join(d, f), folder)
                for d, _, names in os.walk(folder) for f in names)


@pytest.fixture
def tiers(tmp_path):
  tiers, _ = tier_runs.linked_tiers(str(tmp_path / "local"))
  yield tiers
  for tier in tiers:
    tier.close()


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
    connected, served = (int(w) for w in re.findall(r"\d+", attacks["200 connections at once"]))
    assert connected == 200 and served <= peers.max_connections(2), attacks
    assert attacks["after the flood"] == f"open, answered {HELLO} bytes", attacks  # still serving


def test_a_stranger_on_the_host_is_dropped_and_nothing_is_written(tiers, tmp_path):
  """No secret, a wrong one, the old unauthenticated frame, traversal ids, an oversized header, 200 at once."""
  canary = str(tmp_path / "escaped")
  tier_runs.save_local(tiers[1], 2)  # Worker 0 keeps worker 1's data position of step 2.
  before = [_files(t.layout.directory) for t in tiers]
  targets = [f"localhost:{t.link.port}" for t in tiers]
  report = {t: ft_stranger.attacks(t, canary) for t in targets}
  _assert_stranger_failed(report, canary)
  # A worker of the job sending malformed frames (the secret, but bad fields): dropped too.
  insider = ft_stranger.insider_frames(lambda: tiers[0].link._connect(1), canary)  # pylint: disable=protected-access
  assert all(o.startswith("closed") for o in insider.values()), insider
  assert not os.path.exists(canary)
  assert [_files(t.layout.directory) for t in tiers] == before
  assert tiers[1].link.refusals.count >= len(insider) + 5
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
      conn.sendall(wire.MAGIC + os.urandom(32))
      wire.recv_exact(conn, wire.ANSWER_BYTES)
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
    stranger._peers = tiers[0].link._peers  # pylint: disable=protected-access
    with pytest.raises(ConnectionError):  # tiers[1] drops it before its proof.
      stranger._connect(1)  # pylint: disable=protected-access
  finally:
    for tier in other:
      tier.close()
  tiers[0].link._peers[1] = ("localhost", _impostor())  # pylint: disable=protected-access
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
  assert insider and all(o.startswith("closed") for o in insider.values()), insider
  with open(os.path.join(root, "attack", "check.json"), encoding="utf-8") as f:
    check = json.load(f)  # Worker 1's tier right after the attacks.
  allowed = {f"ckpt-{s}.manifest.json" for s in range(check["step"] + 1)}
  allowed |= {f"peer-0/ckpt-{s}" for s in range(check["step"] + 1)} | {"ckpt.slot-0", "ckpt.slot-1"}
  assert set(check["files"]) <= allowed, check
  assert check["refused"] >= len(insider) + 5 and check["threads"] < 20, check
  # Each kind of problem is logged once per worker, not once per connection.
  for line in ("failed authentication: not a worker of this job", "connections at once"):
    assert out.count(line) <= 2, (line, out.count(line))
