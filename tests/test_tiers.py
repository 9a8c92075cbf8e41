"""The local checkpoint tier in one process: the choice of what to restore, what peers send, fallbacks."""

import dataclasses
import os
import shutil
import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import reads
from tfdp.checkpoint.local import tier as local_lib
from tfdp.checkpoint.format import commit as commit_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import verify as verify_lib
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.local import generations
from tfdp.checkpoint.format import planner
from tfdp.checkpoint import restore as restore_lib
from tfdp.checkpoint import recovery
from tfdp.checkpoint.persistent import writer as storage
from tfdp.checkpoint.local import wire


def _row(persistent, *held, kept=(), no_peer=False, link=True):
  """An `offer` row: held = (step, required) pairs, newest first; kept: steps of the left neighbour's per-worker state."""
  copies = [local_lib.Held(step, f"ckpt-{step}", manifest_lib.Manifest(
      0, step, per_worker_required=bool(required))) for step, required in held]
  return recovery.offer(copies, persistent, kept, no_peer=no_peer, link=link)


@pytest.mark.parametrize("rows,expected", [
    # Every worker holds the newest: each restores its own copy.
    ([_row(20, (35, 0), (30, 0)), _row(20, (35, 0), (30, 0))], ("local", 35, (0, 1))),
    # Worker 1 lost its tier: worker 0 sends step 35.
    ([_row(20, (35, 0), (30, 0)), _row(20)], ("peer", 35, (0,))),
    # Worker 1 missed the newest save: still the newest, from worker 0.
    ([_row(20, (35, 0), (30, 0)), _row(20, (30, 0))], ("peer", 35, (0,))),
    # With required per-worker state (a plain fit's data position) no peer
    # can stand in: the newest step both hold...
    ([_row(20, (35, 1), (30, 1)), _row(20, (30, 1))], ("local", 30, (0, 1))),
    # ... or the persistent tier.
    ([_row(20, (35, 1), (30, 1)), _row(20)], ("persistent", None, ())),
    # Local copies older than the persistent tier, or none at all.
    ([_row(40, (35, 0)), _row(40, (35, 0))], ("persistent", None, ())),
    ([_row(40), _row(40)], ("persistent", None, ())),
    ([_row(None), _row(None)], ("persistent", None, ())),
    # As new as the persistent tier: local when all hold it (faster), not
    # worth a transfer otherwise.
    ([_row(40, (40, 0)), _row(40, (40, 0))], ("local", 40, (0, 1))),
    ([_row(40, (40, 0)), _row(40)], ("persistent", None, ())),
    # A fresh run: a local copy and no persistent checkpoint yet.
    ([_row(None, (5, 0)), _row(None)], ("peer", 5, (0,))),
    # Required per-worker state that the lost worker's neighbour kept: peer,
    # with it (worker 1's state is kept by worker 0 = 1 + 1 mod 2).
    ([_row(20, (35, 1), (30, 1), kept=(35, 30)), _row(20)], ("peer", 35, (0,), True)),
    # ... only for the steps it kept.
    ([_row(20, (35, 1), (30, 1), kept=(30,)), _row(20)], ("peer", 30, (0,), True)),
    # Three workers, worker 2 lost: worker 0 keeps its state.
    ([_row(20, (35, 1), kept=(35,)), _row(20, (35, 1)), _row(20)], ("peer", 35, (0, 1), True)),
    ([_row(20, (35, 1)), _row(20, (35, 1), kept=(35,)), _row(20)], ("persistent", None, ())),
])
def test_the_workers_choose_the_newest_state_they_can_have(rows, expected):
  choice = recovery.choose(np.array(rows))
  got = (choice.kind, choice.step, choice.holders)
  assert (got + (True,) if choice.per_worker else got) == expected


def test_per_worker_tensors_cross_the_side_channel_bitwise_for_every_dtype():
  """-0.0, NaN payloads, odd dtypes and strings: what a neighbour keeps and sends back."""
  from tests.test_slots import VALUES, _same  # pylint: disable=g-import-not-at-top
  description, blobs = wire.tensors_to_wire(VALUES)
  out = wire.tensors_from_wire(description, [bytes(b) for b in blobs])
  for key, value in VALUES.items():
    _same(out[key], value, key)


def _send(tier, held, offer):
  """The holder's slot over a real socket (sendfile), into the receiver's slot."""
  path, size = tier.send_of(held)
  a, b = socket.socketpair()

  def send():
    with open(path, "rb") as f, a:
      a.sendfile(f, 0, size)

  sender = threading.Thread(target=send)
  sender.start()
  try:
    offer.receive(b)
  finally:
    sender.join()
    b.close()


def test_a_copy_sent_by_a_peer_becomes_this_workers_own_and_restores_bitwise(tmp_path):
  """The holder's slot as it is, plus this worker's per-worker state (from its neighbour), after it."""
  from tests.test_slots import VALUES, _same  # pylint: disable=g-import-not-at-top
  holder = local_lib.LocalTier(layout_lib.Layout(str(tmp_path / "w0"), "ckpt"),
                               cluster.Worker(0, 2), 5, 60)
  receiver = local_lib.LocalTier(layout_lib.Layout(str(tmp_path / "w1"), "ckpt"),
                                 cluster.Worker(1, 2), 5, 60)
  for tier in (holder, receiver):
    tier.start("token", "session")
  state = {k: tf.Variable(v) for k, v in VALUES.items() if v.dtype != tf.string}
  ckpt = tf.train.Checkpoint(**state)
  items = items_lib.gather(ckpt)
  items.append(planner.Item(layout_lib.per_worker_prefix(0) + "data", "",
                            tf.constant(b"holder's position"), 0))
  meta = manifest_lib.SaveMeta.new(7, 7, None, None, ["data"], tier="local", run_token="token")
  holder.save(7, lambda: items, lambda: meta)
  holder.wait()
  (held,) = holder.held()
  # What the side channel checks and where the bytes land, from the offer's record.
  offer = receiver._incoming(7, held.manifest.to_json(), [held.manifest.slot.size])  # pylint: disable=protected-access
  _send(holder, held, offer)
  got = receiver.receive(7, offer, {"data": tf.constant(b"receiver's position")})
  assert got.prefix == str(tmp_path / "w1" / "ckpt-7") and receiver.held()[0].step == 7
  fresh = {k: tf.Variable(tf.zeros_like(v)) for k, v in state.items()}
  tensors = copies.restore(tf.train.Checkpoint(**fresh), receiver.layout, got.prefix,
                           got.manifest)
  for key, value in state.items():
    _same(fresh[key], value, key)
  assert tensors[layout_lib.per_worker_prefix(1) + "data"] == b"receiver's position"
  copies.readable(receiver.layout, got.prefix, got.manifest)  # TF reads it too.
  reader = tf.train.load_checkpoint(got.prefix)
  assert reader.get_tensor(layout_lib.per_worker_prefix(1) + "data") == b"receiver's position"
  # A received copy (worker 0's state in it) sent back to a replaced worker 0:
  # worker 0's state is the one the copy holds.
  holder.drop()
  offer = holder._incoming(7, got.manifest.to_json(), [got.manifest.slot.size])  # pylint: disable=protected-access
  _send(receiver, got, offer)
  again = holder.receive(7, offer, {"data": tf.constant(b"another position")})
  assert again.manifest.per_worker_required
  tensors = copies.restore(tf.train.Checkpoint(**fresh), holder.layout, again.prefix,
                           again.manifest)
  assert tensors[layout_lib.per_worker_prefix(0) + "data"] == b"holder's position"


class _Run:
  """A tiny training state with a persistent and a local tier, in one process."""

  def __init__(self, root, local_every=5, every=10, last=None):
    self.root, self.last = root, last
    self.v = tf.Variable(tf.zeros([64]))
    self.step = tf.Variable(0, dtype=tf.int64)
    self.ckpt = tf.train.Checkpoint(v=self.v, step=self.step)
    self.manager = tfdp.CheckpointManager(
        self.ckpt, os.path.join(root, "model"), step_counter=self.step,
        checkpoint_interval=every, last_checkpoint_step=last,
        local_checkpoint_dir=os.path.join(root, "local"), local_checkpoint_every_steps=local_every)

  def train(self, to, bump=0.0):
    """Steps to `to`; `bump` changes what a step adds (other bits, as nondeterministic kernels give)."""
    for i in range(int(self.step.numpy()) + 1, to + 1):
      self.step.assign(i)
      self.v.assign_add(tf.fill([64], float(i) + bump))
      self.manager.save()
      # A local save while the previous one is being written is skipped:
      # waiting makes which steps are kept certain.
      self.manager.sync()

  def restart(self):
    self.manager.close()
    return _Run(self.root, self.manager.local_checkpoint_every_steps,
                self.manager.checkpoint_interval, self.last)

  def value_at(self, step):
    return np.full([64], sum(range(1, step + 1)), np.float32)


@pytest.fixture
def run(tmp_path):
  return _Run(str(tmp_path))


def test_a_restart_takes_the_newer_local_copy_without_reading_the_persistent_one(run, monkeypatch):
  run.train(27)  # Persistent at steps 1, 11, 21; local every 5 steps, one copy in each slot.
  assert [os.path.basename(p) for p in run.manager.local_checkpoints()] == ["ckpt-20", "ckpt-25"]
  read = []
  real = copies.restore
  monkeypatch.setattr(copies, "restore", lambda c, l, p, m, a=None, **kw: (read.append(p), real(
      c, l, p, m, a, **kw))[1])
  monkeypatch.setattr(restore_lib, "restore_verified", None)  # The persistent tier is not read.
  again = run.restart()
  prefix = again.manager.restore_or_initialize()
  assert again.manager.restored_tier == "local" and prefix.endswith("worker-0/ckpt-25")
  assert read == [prefix]
  assert int(again.step.numpy()) == 25
  np.testing.assert_array_equal(again.v.numpy(), run.value_at(25))


def _flip(manager, step, key="v/.ATTRIBUTES/VARIABLE_VALUE"):
  """Flips one byte of tensor `key` in the slot of local copy `step`."""
  tier = manager._local  # pylint: disable=protected-access
  man = manifest_lib.read_manifest(tier.layout.prefix(step))
  entry = next(e for e in man.slot.entries if e.key == key)
  with open(tier.layout.slot(copies.slot_index(tier.layout, man)), "r+b") as f:
    f.seek(entry.offset + entry.size // 2)
    byte = f.read(1)
    f.seek(entry.offset + entry.size // 2)
    f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("local_every,fallback", [(5, "persistent"), (1, "local")])
def test_a_flipped_byte_in_the_newest_slot_is_named_and_the_run_ends_bitwise_equal(
    tmp_path, caplog, local_every, fallback):
  """The restore names the tensor and takes the other slot (or the persistent tier); nothing of the damaged copy is assigned."""
  run = _Run(str(tmp_path), local_every=local_every)
  run.train(27)  # Persistent at 21; local 20 and 25 (every 5), or 26 and 27 (every step).
  newest = max(layout_lib.number_of(p) for p in run.manager.local_checkpoints())
  prefix = run.manager._local.layout.prefix(newest)  # pylint: disable=protected-access
  verify_lib.verify(prefix)  # What tfdp-ckpt verify does: every CRC32C.
  _flip(run.manager, newest)
  with pytest.raises(errors.CorruptCheckpointError, match="VARIABLE_VALUE' does not match"):
    verify_lib.verify(prefix)
  again = run.restart()
  with caplog.at_level("WARNING"):
    again.manager.restore_or_initialize()
  assert "tensor 'v/.ATTRIBUTES/VARIABLE_VALUE' does not match its CRC32C" in caplog.text
  assert again.manager.restored_tier == fallback
  assert int(again.step.numpy()) == {"persistent": 21, "local": 26}[fallback]
  again.train(30)
  np.testing.assert_array_equal(again.v.numpy(), run.value_at(30))  # bitwise: exact float32
  # A truncated slot is found before any read.
  with open(again.manager._local.slots[0].path, "r+b") as f:  # pylint: disable=protected-access
    f.truncate(10)
  with open(again.manager._local.slots[1].path, "r+b") as f:  # pylint: disable=protected-access
    f.truncate(10)
  third = again.restart()
  third.manager.restore_or_initialize()
  assert third.manager.restored_tier == "persistent" and int(third.step.numpy()) == 21


def test_a_lost_local_tier_restores_from_the_persistent_tier(run):
  run.train(27)
  shutil.rmtree(os.path.join(run.root, "local"))
  again = run.restart()
  again.manager.restore_or_initialize()
  assert again.manager.restored_tier == "persistent" and int(again.step.numpy()) == 21
  np.testing.assert_array_equal(again.v.numpy(), run.value_at(21))


def test_local_copies_of_an_earlier_run_in_the_same_place_are_ignored(run):
  run.train(27)
  run.manager.close()
  shutil.rmtree(os.path.join(run.root, "model"))  # A new run: the same model_dir, empty.
  fresh = _Run(run.root)
  assert fresh.manager.restore_or_initialize() is None
  assert int(fresh.step.numpy()) == 0 and fresh.manager.local_checkpoints() == []


def test_a_local_restore_that_fails_moves_on_and_a_restart_does_not_try_it_again(run, monkeypatch,
                                                                               caplog):
  """Finding 1: a read error of the local copy (not damage) was fatal, and again at every restart."""
  run.train(27)  # Persistent at steps 1, 11, 21; local at 20 and 25.

  def flaky(*args, **kwargs):
    raise OSError("injected: the local copy cannot be read now")

  monkeypatch.setattr(copies, "restore", flaky)
  again = run.restart()
  with caplog.at_level("WARNING"):
    assert again.manager.restore_or_initialize().endswith("model/ckpt-3")
  assert again.manager.restored_tier == "persistent" and int(again.step.numpy()) == 21
  (line,) = [r.getMessage() for r in caplog.records if "restore: tried" in r.getMessage()]
  assert "tried local step 25 (failed on worker(s) [0]); restored" in line and "ckpt-3" in line
  # The copy that failed is gone: the next restart does not make that choice again.
  assert [os.path.basename(p) for p in again.manager.local_checkpoints()] == ["ckpt-20"]


def test_a_persistent_checkpoint_that_cannot_be_read_now_is_left_as_it_is(tmp_path, monkeypatch):
  """A transient read error of the newest: the one before is restored, the newest stays on disk
  (a later save replaces it); with none readable, the restore raises rather than start over."""
  run = _Run(str(tmp_path), local_every=None)
  run.train(27)  # ckpt-1..3 at steps 1, 11, 21.
  real = restore_lib.restore_verified
  unreadable = {"ckpt-3"}

  def flaky(checkpoint, prefix, man):
    if os.path.basename(prefix) in unreadable:
      raise tf.errors.UnavailableError(None, None, "injected: the storage is away")
    return real(checkpoint, prefix, man)

  monkeypatch.setattr(restore_lib, "restore_verified", flaky)
  # Every retry still happens, without its pause (1.2 s a checkpoint, 4.8 s here).
  monkeypatch.setattr(restore_lib, "READ_RETRIES", (0.0, 0.0))
  again = run.restart()
  assert again.manager.restore_or_initialize().endswith("ckpt-2")
  assert os.path.exists(os.path.join(run.root, "model", "ckpt-3.manifest.json"))
  again.train(21)  # Saves ckpt-3 again, at step 21 of this attempt.
  assert manifest_lib.read_manifest(os.path.join(run.root, "model", "ckpt-3")).step == 21
  unreadable.update({"ckpt-1", "ckpt-2", "ckpt-3"})
  third = again.restart()
  with pytest.raises(errors.CheckpointError, match="not starting over"):
    third.manager.restore_or_initialize()
  assert sorted(f for f in os.listdir(os.path.join(run.root, "model"))
                if f.endswith("manifest.json")) == [f"ckpt-{n}.manifest.json" for n in (1, 2, 3)]


def test_a_restore_that_failed_half_way_starts_over_from_the_state_before_it(tmp_path):
  """TF may have assigned some variables before a CRC32C failure: they get their values before it back.

  A fresh start with the half would not be one; the run used to stop ("not
  starting over with it") and start over silently on the next.
  """
  run = _Run(str(tmp_path), local_every=None)
  run.train(5)  # ckpt-1 only (persistent at step 1).
  data = layout_lib.data_filename(os.path.join(run.root, "model", "ckpt-1"), 0, 1)
  raw = bytearray(open(data, "rb").read())
  raw[len(raw) // 2] ^= 0xFF
  open(data, "wb").write(bytes(raw))
  again = run.restart()
  assert again.manager.restore_or_initialize() is None  # In the same run.
  assert int(again.step.numpy()) == 0 and not again.v.numpy().any()
  assert os.path.exists(layout_lib.corrupt_path(os.path.join(run.root, "model", "ckpt-1")))


def test_after_a_rollback_no_copy_of_the_abandoned_branch_is_ever_restored(run):
  """Finding 2: copies newer than a restore stayed, stood in for new saves, and came back at a restart."""
  run.train(27)  # Local copies at 20 and 25; persistent ckpt-3 at step 21.
  again = run.restart()
  again.manager.restore(os.path.join(run.root, "model", "ckpt-3"))  # Back to step 21.
  assert [os.path.basename(p) for p in again.manager.local_checkpoints()] == ["ckpt-20"]
  again.train(27, bump=0.5)  # The same steps again, other bits.
  third = again.restart()
  assert third.manager.restore_or_initialize().endswith("worker-0/ckpt-25")
  expected = run.value_at(21) + sum(i + 0.5 for i in range(22, 26))
  np.testing.assert_array_equal(third.v.numpy(), expected)


def test_a_tie_of_the_tiers_restores_the_save_counter_of_the_catalog_and_saves_on(tmp_path):
  """Finding 5: save() took its local copy before save_counter counted the persistent save of that step."""
  run = _Run(str(tmp_path), local_every=5, every=10, last=0)
  gathered = []

  class Counted(reads.CachedGather):

    def __call__(self):
      gathered.append(int(run.step.numpy()))
      return super().__call__()

  run.manager._gather = Counted(run.ckpt)  # pylint: disable=protected-access
  run.train(22)  # Persistent ckpt-1 at step 10, ckpt-2 at step 20; local at 15 and 20.
  # One snapshot at a step of both tiers: the local copies of 10 and 20 took the persistent save's.
  assert gathered == [5, 10, 15, 20], gathered
  persistent = tf.train.load_checkpoint(os.path.join(run.root, "model", "ckpt-2"))
  local = manifest_lib.read_manifest(run.manager.local_checkpoints()[-1])
  # A checkpoint without save_counter yet: not the copy's objects, so TF's restore reads it.
  fresh = tf.train.Checkpoint(v=tf.Variable(tf.zeros([64])), step=tf.Variable(0, dtype=tf.int64))
  tensors = copies.restore(fresh, run.manager._local.layout, run.manager.local_checkpoints()[-1],  # pylint: disable=protected-access
                           local)
  for key in ("v/.ATTRIBUTES/VARIABLE_VALUE", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"):
    assert np.asarray(tensors[key]).tobytes() == persistent.get_tensor(key).tobytes(), key
  assert fresh.v.numpy().tobytes() == persistent.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE").tobytes()
  assert int(fresh.save_counter.numpy()) == 2
  again = run.restart()
  assert again.manager.restore_or_initialize().endswith("worker-0/ckpt-20")
  assert int(again.ckpt.save_counter.numpy()) == 2
  again.train(30)
  assert again.manager.latest_checkpoint.endswith("model/ckpt-3")


def test_the_step_counter_is_the_manifests_step_without_an_interval(tmp_path):
  step = tf.Variable(0, dtype=tf.int64)
  manager = tfdp.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0), step=step),
                                   str(tmp_path), step_counter=step)
  step.assign(40)
  assert manifest_lib.read_manifest(manager.save()).step == 40
  assert manifest_lib.read_manifest(manager.save(checkpoint_number=7)).step == 40


def test_both_tiers_commit_through_one_path_with_one_typed_manifest(run, monkeypatch):
  """Finding 7: two commit paths and two manifest writers (and dead fields of SaveJob)."""
  committed = []
  real = commit_lib.commit

  def commit(prefix, man, fence=None):
    committed.append((os.path.relpath(prefix, run.root), type(man)))
    return real(prefix, man, fence)

  monkeypatch.setattr(commit_lib, "commit", commit)
  run.train(5)  # Persistent at step 1, local at 5.
  assert committed == [("model/ckpt-1", manifest_lib.Manifest),
                       ("local/worker-0/ckpt-5", manifest_lib.Manifest)]
  assert not hasattr(manifest_lib, "write_manifest_dict")
  assert not {"owner", "world_size"} & {f.name for f in dataclasses.fields(storage.SaveJob)}
  local = manifest_lib.read_manifest(run.manager.local_checkpoints()[0])
  assert (local.tier, local.world_size, local.step) == ("local", 1, 5)


def test_a_generation_stays_until_the_next_is_complete_on_every_worker():
  """The issue's replaced host restarting from step 0: pruning to 2 left no step all held."""
  g = generations.Generations(2)
  g.done(0, 24)
  g.done(1, 24)
  g.done(0, 26)  # Worker 1's state of 26 not kept yet: 24 is the newest complete.
  assert g.floor == 24 and g.doomed([22, 24, 26]) == [22]
  assert g.doomed([24, 26, 28]) == []  # 24 stays, however many saves came since ...
  assert g.doomed([24, 26, 28, 30, 32]) == [26]  # ... at most 4 kept, never the floor.
  g.done(1, 28)
  g.done(0, 28)
  assert g.floor == 28 and g.doomed([24, 26, 28]) == [24]
  g.restored(10)  # A restore: what every worker now holds.
  assert g.floor == 10 and g.doomed([8, 10]) == [] and g.doomed([6, 8, 10]) == [6]
  single = generations.Generations(1)
  single.done(0, 5)
  assert single.doomed([0, 5]) == []  # The newest two, as before.


def test_a_replaced_host_finds_a_step_held_everywhere_though_its_sends_failed(tmp_path):
  """Worker 1's sends fail for a while (its neighbour link reset); worker 0 saves on. Then worker 1 loses its host."""
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  tiers, _ = tier_runs.linked_tiers(str(tmp_path))
  try:
    for step in (20, 22):
      for tier in tiers:
        tier_runs.save_local(tier, step)
    tiers[1].link._sends._out[0].shutdown(2)  # pylint: disable=protected-access
    for step in (24, 26, 28):
      for tier in tiers:
        tier_runs.save_local(tier, step)
    rows = [recovery.offer(tiers[0].held(), None, tiers[0].kept_for_left()),
            recovery.offer([], None, [])]  # Worker 1: a new host, an empty tier.
    choice = recovery.choose(np.array(rows))
    assert (choice.kind, choice.step, choice.per_worker) == ("peer", 22, True), (
        tiers[0].committed(), tiers[0].kept_for_left())
  finally:
    for tier in tiers:
      tier.close()


def test_local_tier_arguments_are_checked(tmp_path):
  ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
  plain = tfdp.CheckpointManager(ckpt, str(tmp_path / "a"))
  with pytest.raises(errors.ConfigError, match="needs a local tier"):
    plain.save_local(3)
  with pytest.raises(errors.ConfigError, match="positive number of steps"):
    tfdp.CheckpointManager(ckpt, str(tmp_path / "b"), local_checkpoint_every_steps=-1)
  with pytest.raises(errors.ConfigError, match="needs a MultiWorkerMirroredStrategy"):
    tfdp.CheckpointManager(ckpt, str(tmp_path / "c"), local_checkpoint_every_steps=5,
                           worker_index=0, num_workers=2, run_id="x")
  local = tfdp.CheckpointManager(ckpt, str(tmp_path / "d"), local_checkpoint_every_steps=5)
  with pytest.raises(errors.ConfigError, match="needs step= or the manager's step_counter"):
    local.save_local()
  assert local.local_directory.startswith(layout_lib.user_local_root() + "/")
  local.drop_local()


def test_a_local_save_never_waits_for_the_previous_one(run, monkeypatch):
  """Training blocks only for the snapshot: a save during the previous write waits, the newest only."""
  from tests.workers import local_faults  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  release = threading.Event()
  monkeypatch.setattr(copies, "write", local_faults.before_each_copy(lambda _: release.wait(30)))
  try:
    for step in (3, 4, 5):
      assert run.manager.save_local(step).endswith(f"ckpt-{step}")
    assert run.manager.local_saves_skipped == 1  # 4: 5 came while it waited.
  finally:
    release.set()
  run.manager.sync()
  assert [os.path.basename(p) for p in run.manager.local_checkpoints()] == ["ckpt-3", "ckpt-5"]


def _save_everywhere(tiers, step):
  """Both workers save `step` at once (as training does), then wait for their writers."""
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  for tier in tiers:
    tier_runs.save_local(tier, step, wait=False)
  for tier in tiers:
    tier.wait()


def _held_everywhere(tiers):
  return [[h.step for h in tier.held()] for tier in tiers]


@pytest.fixture
def linked(tmp_path):
  """(the local tiers of a 2-worker job joined by real side channels, an Event that `_hold` waits for)."""
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  with tier_runs.linked(str(tmp_path / "linked")) as tiers:
    release = threading.Event()
    yield tiers, release
    release.set()


def _hold(monkeypatch, worker, release):
  """Holds worker `worker`'s writer before its next fills, until `release` is set."""
  from tests.workers import local_faults  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(copies, "write", local_faults.before_each_copy(
      lambda w: w == worker and release.wait(30)))


def test_a_slot_whose_step_may_still_become_complete_everywhere_is_not_overwritten(tmp_path):
  """The floor lags behind both slots (a fresh start; DONE reports late): the save waits, the older slot stays.

  Worker 0 of 2 saves on while worker 1's parts are done late. Had the third
  save overwritten step 2, a late report for 2 would make it complete on
  every worker with worker 0 no longer holding it.
  """
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  tier = local_lib.LocalTier(layout_lib.Layout(str(tmp_path / "w0"), "ckpt"),
                             cluster.Worker(0, 2), 2, 60)
  tier.start("token", "session")

  def held_while_waiting():
    time.sleep(0.3)
    assert tier.busy() and tier.skipped == 0
    return [h.step for h in reversed(tier.held())]

  try:
    for step in (2, 4):
      tier_runs.save_local(tier, step)
    tier_runs.save_local(tier, 6, wait=False)
    assert tier.generations.floor is None and held_while_waiting() == [2, 4]
    tier.generations.done(1, 2)  # Late: 2 is complete everywhere, 4 not yet.
    assert held_while_waiting() == [2, 4]
    tier.generations.done(1, 4)  # 2 is let go once a newer step is complete.
    tier.wait()
    assert [h.step for h in tier.held()] == [6, 4] and tier.skipped == 0
    tier.generations.restored(1)  # A floor older than both slots: both may become it ...
    tier_runs.save_local(tier, 8, wait=False)
    assert held_while_waiting() == [4, 6]
    tier.generations.done(1, 8)  # ... till worker 1 reports 8, not 6: 6 can never be complete.
    tier.wait()
    assert [h.step for h in tier.held()] == [8, 4] and tier.skipped == 0
  finally:
    tier.close()


def test_a_save_waits_for_a_slot_only_while_every_worker_may_still_report(linked, tmp_path):
  """Worker 0 holds 2 (the floor) and 4, which worker 1 never saves: its next save is skipped once worker 1 is gone, or after the tier's timeout."""
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  tiers, _ = linked
  _save_everywhere(tiers, 2)
  for step in (4, 6):
    tier_runs.save_local(tiers[0], step, wait=False)
  time.sleep(0.3)
  assert tiers[0].busy() and tiers[0].skipped == 0
  tiers[1].close()  # Its connections end: it reports no more.
  tiers[0].wait()
  assert [h.step for h in tiers[0].held()] == [4, 2] and tiers[0].skipped == 1
  alone = local_lib.LocalTier(layout_lib.Layout(str(tmp_path / "w0"), "ckpt"),
                              cluster.Worker(0, 2), 2, 0.5)
  alone.start("token", "session")
  try:
    for step in (2, 4, 6):
      tier_runs.save_local(alone, step)
    assert [h.step for h in alone.held()] == [4, 2] and alone.skipped == 1
  finally:
    alone.close()


def test_a_copy_received_at_a_restore_never_lands_on_the_step_it_falls_back_to(tmp_path):
  """Worker 1 holds 2 (which worker 0 holds too) and 4; worker 0 sends 6, and the transfer stops half way.

  The bytes of 6 go over 4: 2, what every worker falls back to, is intact.
  """
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import slot_file  # pylint: disable=g-import-not-at-top
  rows = [_row(None, (6, 0), (2, 0)), _row(None, (4, 0), (2, 0))]
  assert recovery.choose(rows) == recovery.Choice("peer", 6, (0,))
  assert recovery.fallback(rows, 6) == 2 and recovery.fallback(rows, 2) is None
  assert recovery.fallback([_row(None, (6, 0)), _row(None)], 6) is None
  holder, receiver = (local_lib.LocalTier(layout_lib.Layout(str(tmp_path / f"w{w}"), "ckpt"),
                                          cluster.Worker(w, 2), 2, 60) for w in (0, 1))
  try:
    for tier, steps in ((holder, (2, 6)), (receiver, (2, 4))):
      tier.start("token", "session")
      for step in steps:
        tier_runs.save_local(tier, step)
    four = receiver.layout.slot(copies.slot_index(receiver.layout, receiver.held()[0].manifest))
    (held,) = [h for h in holder.held() if h.step == 6]
    receiver.receiving(keep=recovery.fallback(rows, 6))
    offer = receiver._incoming(6, held.manifest.to_json(), [held.manifest.slot.size])  # pylint: disable=protected-access
    assert offer.slot.path == four and [h.step for h in receiver.held()] == [2]
    path, size = holder.send_of(held)
    a, b = socket.socketpair()
    with open(path, "rb") as f:
      a.sendall(f.read(size // 2))
    a.close()
    with pytest.raises(ConnectionError):
      offer.receive(b)
    b.close()
    (kept,) = receiver.held()
    got = slot_file.read(receiver.layout.slot(copies.slot_index(receiver.layout, kept.manifest)),
                     kept.manifest.slot.entries, kept.manifest.slot.size)
    assert kept.step == 2 and got["v"].tolist() == [2.0] * 4
  finally:
    holder.close()
    receiver.close()


def test_a_late_report_makes_a_save_wait_and_never_stops_the_local_tier(linked, monkeypatch):
  """Both hold 2; worker 1 writes 4 late, after worker 0's save of 6 came (so 2 is still the floor there).

  Had worker 0 skipped 6 (it waited 1 s for 4 to be complete), worker 1
  would hold 4 and 6 and wait for 6 to be complete, worker 0 4 and 8 and
  wait for 8: no local save on any worker ever again. Worker 0's save of 6
  waits for 4 instead.
  """
  from tests import tier_runs  # pylint: disable=g-import-not-at-top
  tiers, release = linked
  _save_everywhere(tiers, 2)
  _hold(monkeypatch, 1, release)
  tier_runs.save_local(tiers[1], 4, wait=False)
  tier_runs.save_local(tiers[0], 4)
  tier_runs.save_local(tiers[0], 6, wait=False)  # 2 is the floor: the older slot stays.
  time.sleep(1.5)
  assert _held_everywhere(tiers) == [[4, 2], [2]]
  release.set()
  tiers[1].wait()
  tier_runs.save_local(tiers[1], 6)
  tiers[0].wait()
  for step in (8, 10):
    _save_everywhere(tiers, step)
  assert _held_everywhere(tiers) == [[10, 8], [10, 8]]
  assert [t.skipped for t in tiers] == [0, 0] and [t.generations.floor for t in tiers] == [10, 10]


def test_a_save_missing_on_one_worker_only_never_stops_the_local_tier(linked, monkeypatch):
  """Worker 0's save of 8 fails (a save skipped or lost on one worker): worker 1 holds 8, worker 0 does not.

  8 can never be complete. Once worker 0 reports 10, worker 1 knows it (a
  worker reports its steps in order) and fills 8's slot with 10, never the
  slot of 6, the floor. Had it waited for 8 instead, every later save would
  have waited for a step some worker never saved. (With several workers a
  save waits for the one being written rather than replacing it, so a save
  goes missing on one worker only when it fails there.)
  """
  from tests.workers import local_faults  # pylint: disable=g-import-not-at-top
  tiers, _ = linked
  for step in (2, 4, 6):
    _save_everywhere(tiers, step)
  fills = []

  def fail_the_next_fill(worker):
    if worker == 0 and not fills:
      fills.append(worker)
      raise OSError("injected: worker 0's save of step 8 fails")

  monkeypatch.setattr(copies, "write", local_faults.before_each_copy(fail_the_next_fill))
  _save_everywhere(tiers, 8)
  # Worker 0 let 4's record go before the fill that failed (a torn slot never wins).
  assert fills and _held_everywhere(tiers) == [[6], [8, 6]]
  _save_everywhere(tiers, 10)
  assert _held_everywhere(tiers) == [[10, 6], [10, 6]]
  _save_everywhere(tiers, 12)
  assert _held_everywhere(tiers) == [[12, 10], [12, 10]]
  assert [t.generations.floor for t in tiers] == [12, 12]
