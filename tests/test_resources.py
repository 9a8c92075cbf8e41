"""What the local tier and goodput hold on to: the side channel ends with close(), cut-short writes are removed, mmaps go."""

import json
import os
import socket
import threading
import time

import pytest

from tests import tier_runs
from tfdp import goodput
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.local import wire


def _peer_threads():
  return [t for t in threading.enumerate() if t.name.startswith("tfdp-peer")]


def test_close_ends_the_side_channel_its_threads_and_its_connections(tmp_path):
  before = set(_peer_threads())
  tiers, _ = tier_runs.linked_tiers(str(tmp_path))
  for step in (2, 4):  # The neighbour connections are open and served.
    for tier in tiers:
      tier_runs.save_local(tier, step)
  assert len(set(_peer_threads()) - before) >= 4
  ports = [t.link.port for t in tiers]
  for tier in tiers:
    tier.close()
  deadline = time.monotonic() + 10
  while set(_peer_threads()) - before and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not set(_peer_threads()) - before, _peer_threads()
  for port in ports:
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(("localhost", port), timeout=5).close()
  # A closed link sends nothing and the save goes on: not done, not kept.
  tier_runs.save_local(tiers[1], 6)
  assert tiers[1].generations.floor == 4 and 6 not in tiers[0].kept_for_left()


def test_what_a_write_cut_short_left_is_removed_when_the_tier_starts(tmp_path):
  """A SIGKILL in the middle of keeping a neighbour's state, of writing a record, of making a TF index."""
  tiers, _ = tier_runs.linked_tiers(str(tmp_path))
  tier_runs.save_local(tiers[1], 2)
  for tier in tiers:
    tier.close()
  folder = tiers[0].layout.directory
  kept = layout_lib.peer_copy_path(folder, 1, "ckpt", 2)
  prefix = tiers[0].layout.prefix(6)
  torn = [layout_lib.atomic_tmp_path(layout_lib.peer_copy_path(folder, 1, "ckpt", 4)),
          layout_lib.atomic_tmp_path(layout_lib.manifest_path(prefix)),
          layout_lib.index_path(prefix), layout_lib.index_path(prefix) + ".tempstate123",
          layout_lib.data_filename(prefix, 0, 1) + ".tempstate123"]
  for path in torn:
    with open(path, "wb") as f:
      f.write(b"half")
  again, _ = tier_runs.linked_tiers(str(tmp_path))
  try:
    assert not [p for p in torn if os.path.exists(p)]
    assert os.path.exists(kept) and again[0].kept_for_left() == [2]
  finally:
    for tier in again:
      tier.close()


def test_a_copy_cut_short_in_transfer_leaves_nothing(tmp_path):
  tiers, _ = tier_runs.linked_tiers(str(tmp_path))
  try:
    tier_runs.save_local(tiers[0], 6)
    (held,) = tiers[0].held()
    key = tiers[1].link.expect(wire.COPY, 6, 0)
    path, size = tiers[0].send_of(held)
    head = json.dumps({"kind": wire.COPY, "step": 6, "from": 0, "sizes": [size],
                       "manifest": held.manifest.to_json()}).encode()
    with tiers[0].link._connect(1) as sock:  # pylint: disable=protected-access
      sock.start_frame(head)  # The header and its MAC, then half of the bytes.
      sock.sendall(open(path, "rb").read(size // 2))
      # ... and the holder dies.
    with pytest.raises(ConnectionError, match="stopped in the middle"):
      tiers[1].link.wait(key)
    assert not tiers[1].held()  # No record names the slot the bytes landed in.
  finally:
    for tier in tiers:
      tier.close()


def _mapped(path):
  with open("/proc/self/maps", encoding="utf-8") as f:
    return any(path in line for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_finished_run_unmaps_its_progress_file(tmp_path, monkeypatch):
  monkeypatch.delenv("TFDP_GOODPUT_FILE", raising=False)
  recorder = goodput.Recorder(str(tmp_path), tensorboard=False)
  (progress,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                 if f.startswith("progress-")]
  recorder.step(1)
  assert _mapped(progress)
  recorder.finished(1)
  assert not _mapped(progress)
  recorder.step(2)  # Training again with the same recorder maps it again.
  assert _mapped(progress)
  recorder.finished(2)
  assert not _mapped(progress)
