"""The local tier's slots: bytes at fixed offsets with a CRC32C each, read back bitwise, TF's reader on them, a SIGKILL mid-fill."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import shared
from tests.conftest import REPO
from tfdp.checkpoint.format import checksum
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import slot_file
from tfdp.checkpoint.format.planner import Item
from tfdp.checkpoint.local import bundle
from tfdp.checkpoint.local import slots

VALUES = {
    "f32": tf.constant([-0.0, 0.0, 1.5, np.nan, -np.inf], tf.float32),
    "f64": tf.constant([-0.0, 1e-300], tf.float64),
    "f16": tf.constant([-0.0, 65504.0, 1e-7], tf.float16),
    "bf16": tf.constant([-0.0, 3.0], tf.bfloat16),
    "i8": tf.constant([-128, 127], tf.int8),
    "u8": tf.constant([0, 255], tf.uint8),
    "i32": tf.constant([-(2 ** 31), 2 ** 31 - 1], tf.int32),
    "i64": tf.constant([[-(2 ** 63)], [2 ** 63 - 1]], tf.int64),
    "bool": tf.constant([True, False]),
    "c64": tf.constant([1 + 2j], tf.complex64),
    "empty": tf.zeros([0, 3], tf.float32),
    "scalar": tf.constant(7, tf.int64),
    "str": tf.constant(b"{\"run\": 1}\x00\xff"),
    "strs": tf.constant([[b"", b"abc"], [b"\x00" * 9, b"z" * 300]]),
    "nostrs": tf.zeros([0], tf.string),
}


def _same(got, value, key):
  got = tf.convert_to_tensor(got)
  assert got.dtype == value.dtype and got.shape == value.shape, key
  if value.dtype == tf.string:
    assert np.array(got.numpy()).tolist() == np.array(value.numpy()).tolist(), key
  else:
    assert got.numpy().tobytes() == value.numpy().tobytes(), key


def _fill(path, values=VALUES):
  slot = slots.Slot(str(path))
  entries, used = slot.fill([Item(k, "", v, None) for k, v in values.items()])
  return slot, entries, used


def test_every_dtype_comes_back_bitwise_from_the_slot_and_through_tfs_own_reader(tmp_path):
  """-0.0, NaN payloads, bfloat16, empty tensors, strings: read by tfdp, and by TF via an index."""
  slot, entries, used = _fill(tmp_path / "ckpt.slot-0")
  assert all(e.offset % 64 == 0 for e in entries)
  got = slot_file.read(slot.path, entries, used)
  for key, value in VALUES.items():
    _same(got[key], value, key)
  prefix = str(tmp_path / "ckpt-3")
  bundle.write(prefix, slot.path, entries)
  reader = tf.train.load_checkpoint(prefix)  # TF checks each tensor's CRC32C as it reads.
  for key, value in VALUES.items():
    _same(reader.get_tensor(key), value, key)


def test_a_flipped_byte_is_named_by_its_tensor_for_tfdp_and_for_tf(tmp_path):
  slot, entries, used = _fill(tmp_path / "ckpt.slot-0")
  prefix = str(tmp_path / "ckpt-3")
  bundle.write(prefix, slot.path, entries)
  for key in ("f64", "strs"):
    e = next(e for e in entries if e.key == key)
    with open(slot.path, "r+b") as f:
      f.seek(e.offset + e.size - 1)
      byte = f.read(1)
      f.seek(e.offset + e.size - 1)
      f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(Exception, match=f"tensor '{key}' does not match its CRC32C"):
      slot_file.read(slot.path, entries, used)
    with pytest.raises(tf.errors.OpError, match="Checksum does not match|checksum"):
      tf.train.load_checkpoint(prefix).get_tensor(key)
    with open(slot.path, "r+b") as f:
      f.seek(e.offset + e.size - 1)
      f.write(byte)
  slot_file.read(slot.path, entries, used)


def test_offsets_stay_fixed_and_an_unchanged_string_object_is_not_written_again(tmp_path, monkeypatch):
  big = tf.constant(b"p" * 100_000)  # A data position saved against one iterator state.
  values = {"w": tf.ones([1000]), "pos": big, "json": tf.constant(b"{}")}
  slot, first, _ = _fill(tmp_path / "ckpt.slot-0", values)
  at = []  # Where bytes were copied to (a string's bytes: after its lengths).
  real = slots.Slot._write_buffer  # pylint: disable=protected-access
  monkeypatch.setattr(slots.Slot, "_write_buffer",
                      lambda self, buf, off, crc: at.append(off) or real(self, buf, off, crc))
  again = dict(values, w=tf.zeros([1000]), json=tf.constant(b'{"a": 1}'))
  second, used = slot.fill([Item(k, "", v, None) for k, v in again.items()])
  assert [e.offset for e in first] == [e.offset for e in second]
  written = {e.key for e in second for a in at if e.offset <= a < e.offset + max(e.size, 1)}
  assert sorted(written) == ["json", "w"]
  got = slot_file.read(slot.path, second, used)
  assert got["pos"] == b"p" * 100_000 and got["json"] == b'{"a": 1}' and not got["w"].any()


def test_a_string_saved_unchanged_is_made_into_bytes_once_among_strings_that_change(monkeypatch):
  """A save holds a few strings that change at every step (metrics, counters) beside ones that do not (the object graph, a data position): those are made into bytes once."""
  made = []
  real = slots._string_head  # pylint: disable=protected-access
  monkeypatch.setattr(slots, "_string_head",
                      lambda values: made.append(bytes(values[0])) or real(values))
  fixed = tf.constant(b"g" * 5000)
  for step in range(20):
    changing = {f"s{k}": tf.constant(f"{step}.{k}".encode()) for k in range(3)}
    for key, value in dict(changing, graph=fixed).items():
      slots.source(key, value)
  assert made.count(b"g" * 5000) == 1, made.count(b"g" * 5000)


def test_a_fill_of_many_tensors_leaves_the_garbage_collector_nothing_per_tensor_to_track(tmp_path):
  """A real model saves hundreds of tensors at every save. Each object the writer makes per tensor that lives until a collection adds to the full collections of the process's whole heap (about 350 ms each for a TF process, docs/performance.md): a fill makes none but each tensor's record (its shape a tuple of numbers, which the collector stops tracking)."""
  values = [Item(f"layer_{i}/kernel", "", tf.fill([10, 10], float(i)), None) for i in range(2000)]
  slot = slots.Slot(str(tmp_path / "ckpt.slot-0"))
  slot.fill(values)  # Places them; later fills reuse the places, as every save after the first.
  collections = []
  gc.collect()
  old = gc.get_threshold()
  gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
  gc.set_threshold(50, 1 << 30, 1 << 30)  # A young collection at every 50 objects made, and no other.
  try:
    entries, _ = slot.fill(values)
  finally:
    gc.set_threshold(*old)
    gc.callbacks.pop()
  # Each shape: 1 object a tensor, 40 collections. With a record
  # (SlotTensor) each besides: 80; with a source, its shape list and its
  # buffers' list too: 157.
  assert len(collections) < 1.5 * len(values) / 50, len(collections)
  gc.collect()
  assert not any(gc.is_tracked(s) for s in entries.shapes)
  assert entries[7] == ("layer_7/kernel", "float32", (10, 10), entries[7].offset, 400,
                        checksum.value(np.full([10, 10], 7.0, np.float32).tobytes()))


def test_the_records_of_a_held_copy_leave_the_garbage_collector_nothing_per_tensor_to_track(
    tmp_path):
  """A copy's record lives while the copy is held (two saves at least), so each object of it the collector tracks ends up in its oldest generation, where every 25% more objects start a full collection of the whole heap (docs/performance.md, "Sixth pass"). Its records, as filled and as read back from the manifest, are a few objects whatever the number of tensors."""
  values = [Item(f"layer_{i}/kernel", "", tf.fill([10, 10], float(i)), None) for i in range(2000)]
  slot = slots.Slot(str(tmp_path / "ckpt.slot-0"))
  slot.fill(values)
  gc.collect()
  before = len(gc.get_objects())
  entries, used = slot.fill(values)
  record = manifest_lib.FileRecord("ckpt.slot-0", used, entries=entries)
  read = manifest_lib.FileRecord.from_dict(json.loads(json.dumps(record.to_dict())))
  gc.collect()
  assert len(gc.get_objects()) - before < 50, len(gc.get_objects()) - before
  assert read.entries == entries == list(entries) and len(read.entries) == 2000
  assert read.entries[3] == entries[3] and read.entries[3].shape == (10, 10)
  assert json.dumps(read.to_dict()) == json.dumps(record.to_dict())
  assert slot_file.read(slot.path, read.entries, used)["layer_9/kernel"][0, 0] == 9.0
  del read, record


def test_bytes_received_from_a_socket_are_checked_as_they_land(tmp_path):
  slot, entries, used = _fill(tmp_path / "ckpt.slot-0")
  target = slots.Slot(str(tmp_path / "ckpt.slot-1"))

  def send(data):
    a, b = socket.socketpair()
    threading.Thread(target=lambda: (a.sendall(data), a.close()), daemon=True).start()
    try:
      dst, allocate = target.receivable(used)
      slot_file.receive(b.recv_into, dst, entries, target.path, allocate=allocate)
    finally:
      b.close()

  raw = bytearray(open(slot.path, "rb").read()[:used])
  send(bytes(raw))
  got = slot_file.read(target.path, entries, used)
  for key, value in VALUES.items():
    _same(got[key], value, key)
  e = next(e for e in entries if e.key == "i32")
  raw[e.offset] ^= 1
  with pytest.raises(ValueError, match="tensor 'i32' does not match"):
    send(bytes(raw))
  raw[e.offset] ^= 1
  with pytest.raises(ConnectionError, match="stopped in the middle"):
    send(bytes(raw[:used // 2]))


def test_records_of_any_shape_that_do_not_describe_the_bytes_are_refused():
  from tfdp.checkpoint.format.manifest import SlotTensor  # pylint: disable=g-import-not-at-top
  good = SlotTensor("a", "float32", [2], 0, 8, 0)
  slot_file.check_entries([good], 8)
  for bad in (dict(dtype="resource"), dict(dtype=None), dict(shape=[3]), dict(shape="2"),
              dict(offset=4), dict(offset=-8), dict(size=8.0), dict(crc32c=2 ** 32),
              dict(key=""), dict(key=7), dict(shape=[True, 2])):
    fields = dict(good._asdict(), **bad)
    with pytest.raises(ValueError):
      slot_file.check_entries([SlotTensor(**fields)], 8)
  with pytest.raises(ValueError, match="overlap"):
    slot_file.check_entries([good, SlotTensor("b", "float32", [1], 4, 4, 0)], 8)
  with pytest.raises(ValueError, match="distinct"):
    slot_file.check_entries([good, SlotTensor("a", "float32", [0], 8, 0, 0)], 8)


_KILLED_MID_FILL = r"""
import os, signal, sys
import tensorflow as tf
import tfdp
from tests.workers import local_faults
from tfdp.checkpoint.local import slots
root = sys.argv[1]
v = tf.Variable(tf.zeros([1 << 16]))
w = tf.Variable(tf.zeros([1 << 16], tf.int32))
step = tf.Variable(0, dtype=tf.int64)
manager = tfdp.CheckpointManager(tf.train.Checkpoint(v=v, w=w, step=step), root + "/model",
                                 local_checkpoint_dir=root + "/local")
for i in range(1, 7):
  step.assign(i)
  v.assign_add(tf.fill([1 << 16], float(i) / 3))
  w.assign_add(tf.fill([1 << 16], i))
  if i == 6:  # The writer thread dies half way through filling the slot of step 4.
    slots.Slot._write_buffer = local_faults.kill_after_tensors(2)
  manager.save_local(i)
  manager.sync()
"""


@pytest.mark.slow
def test_a_writer_killed_in_the_middle_of_a_fill_leaves_the_other_slot_to_restore(tmp_path):
  """SIGKILL after two tensors of the fill (its `Slot._write_buffer` wrapped): the restart restores step 5 from the other slot, bitwise."""
  proc = subprocess.run([sys.executable, "-c", _KILLED_MID_FILL, str(tmp_path)], cwd=REPO,
                        env=shared.environ(TF_CPP_MIN_LOG_LEVEL="2"), timeout=120,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  import tfdp  # pylint: disable=g-import-not-at-top
  v = tf.Variable(tf.zeros([1 << 16]))
  w = tf.Variable(tf.zeros([1 << 16], tf.int32))
  step = tf.Variable(0, dtype=tf.int64)
  manager = tfdp.CheckpointManager(tf.train.Checkpoint(v=v, w=w, step=step),
                                   str(tmp_path / "model"),
                                   local_checkpoint_dir=str(tmp_path / "local"))
  assert manager.restore_or_initialize().endswith("worker-0/ckpt-5")
  assert manager.restored_tier == "local" and int(step.numpy()) == 5
  expected = np.zeros([1 << 16], np.float32)
  for i in range(1, 6):
    expected += np.float32(i / 3)
  assert v.numpy().tobytes() == expected.tobytes()
  assert (w.numpy() == sum(range(1, 6))).all()
  names = sorted(os.listdir(tmp_path / "local" / "worker-0"))
  assert "ckpt-4.manifest.json" not in names and "ckpt-6.manifest.json" not in names, names
  manager.close()


def test_device_tensors_go_to_host_buffers_reused_by_every_save():
  """The GPU path's mechanism, run on CPU: one host variable per tensor, assigned at each save (no GPU here)."""
  from tfdp.checkpoint.format import items as items_lib  # pylint: disable=g-import-not-at-top
  mirrors = items_lib.HostMirrors()
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():  # A plain variable all the same.
    first = mirrors(("k", ""), tf.constant([1.0, 2.0]))
  second = mirrors(("k", ""), tf.constant([3.0, 4.0]))
  assert len(mirrors._vars) == 1 and "CPU" in second.device  # pylint: disable=protected-access
  assert first.numpy().tolist() == [1.0, 2.0] and second.numpy().tolist() == [3.0, 4.0]


def test_the_checksum_is_crc32c_and_leaves_the_gil_to_other_threads():
  """A writer thread's checksum must not stop the training thread's Python (format/checksum.py)."""
  assert checksum.value(b"123456789") == 0xE3069283  # CRC-32C's check value.
  assert checksum.extend(checksum.value(b"1234"), b"56789") == 0xE3069283
  data = np.frombuffer(os.urandom(1 << 20), np.uint8)
  data = np.tile(data, 256)  # 256 MB: tens of ms in one call.
  seconds = []
  worker = threading.Thread(target=lambda: seconds.append(
      (time.perf_counter(), checksum.value(data), time.perf_counter())))
  gaps, last = [], time.perf_counter()
  worker.start()
  while worker.is_alive():  # Held, the GIL would stop this loop for the whole call.
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
  (start, _, end), = seconds
  assert max(gaps) < 0.5 * (end - start), (max(gaps), end - start)
