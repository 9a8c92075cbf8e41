"""A restore's phases: a copy received from a peer is checked once (as it lands), a local one before it is assigned, and each phase's time is kept."""

import pytest
import tensorflow as tf

from tests.test_slots import VALUES, _same
from tests.test_tiers import _send
from tfdp import cluster
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.local import tier as local_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint import recovery
from tfdp.checkpoint.format import slot_file


class _Link:
  """The side channel of a restore that received `offer` already."""

  def __init__(self, offer):
    self._offer = offer

  def wait(self, key):
    del key
    return None, self._offer


def _received(tmp_path):
  """(the state, the receiver's tier, the offer it received from a holder's copy of it)."""
  holder, receiver = [
      local_lib.LocalTier(layout_lib.Layout(str(tmp_path / f"w{i}"), "ckpt"), cluster.Worker(i, 2),
                          5, 60) for i in range(2)]
  for tier in (holder, receiver):
    tier.start("token", "session")
  state = {k: tf.Variable(v) for k, v in VALUES.items() if v.dtype != tf.string}
  meta = manifest_lib.SaveMeta.new(7, 7, None, None, [], tier="local", run_token="token")
  holder.save(7, lambda: items_lib.gather(tf.train.Checkpoint(**state)), lambda: meta)
  holder.wait()
  (held,) = holder.held()
  offer = receiver._incoming(7, held.manifest.to_json(), [held.manifest.slot.size])  # pylint: disable=protected-access
  _send(holder, held, offer)
  return state, receiver, offer


def _counting(monkeypatch):
  checked = []
  real = slot_file.crc_of
  monkeypatch.setattr(slot_file, "crc_of", lambda e, data: checked.append(e.key) or real(e, data))
  return checked


def test_a_copy_received_from_a_peer_is_not_checked_again_before_it_is_assigned(tmp_path,
                                                                                monkeypatch):
  """Its bytes were checked as they landed in this worker's slot; a local restore checks them all."""
  state, receiver, offer = _received(tmp_path)
  fresh = {k: tf.Variable(tf.zeros_like(v)) for k, v in state.items()}
  restore = recovery.TieredRestore(tf.train.Checkpoint(**fresh), receiver, cluster.Worker(1, 2),
                                   None)
  receiver.link = _Link(offer)
  checked = _counting(monkeypatch)
  choice = recovery.Choice("peer", 7, (0,))
  assert restore._transfer(choice, None, [1], ["copy"], None, {}) == recovery.OK  # pylint: disable=protected-access
  (held,) = receiver.held()
  numeric = {e.key for e in held.manifest.slot.entries if e.dtype != "string"}
  assert len(numeric) == len(state) and not numeric & set(checked), checked
  for key, value in state.items():
    _same(fresh[key], value, key)
  phases = restore.phases.take()
  assert {"wait", "commit", "index", "map", "views", "tensors", "assign"} <= set(phases), phases
  assert "check" in phases  # The loop ran, over no fixed-size tensor.
  # The same copy restored as a local copy (a restart): every tensor checked.
  checked.clear()
  copies.restore(tf.train.Checkpoint(**fresh), receiver.layout, held.prefix, held.manifest)
  assert sorted(checked) == sorted(e.key for e in held.manifest.slot.entries)


def test_a_corrupt_received_slot_still_never_wins_a_local_restore(tmp_path):
  """The flag is the receiver's alone: the copy on disk, restored later, is checked whole."""
  state, receiver, offer = _received(tmp_path)
  held = receiver.receive(7, offer, None)
  e = next(e for e in held.manifest.slot.entries if e.key.startswith("f64"))
  with open(receiver.layout.slot(copies.slot_index(receiver.layout, held.manifest)), "r+b") as f:
    f.seek(e.offset)
    byte = f.read(1)
    f.seek(e.offset)
    f.write(bytes([byte[0] ^ 1]))
  fresh = {k: tf.Variable(tf.zeros_like(v)) for k, v in state.items()}
  with pytest.raises(Exception, match=f"tensor '{e.key}' does not match its CRC32C"):
    copies.restore(tf.train.Checkpoint(**fresh), receiver.layout, held.prefix, held.manifest)
