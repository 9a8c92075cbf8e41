"""Every kind of damage to the newest backup of a 2-worker model.fit: set aside and fallen back from in the same run.

One launch makes backups at steps 6 and 9; the test damages a copy of
them per case (a flipped byte in the variables, in worker 0's data
position, in worker 1's callbacks' state, in the index, in the manifest;
a truncated data file; a flipped byte with no older backup) and one more
launch runs the same script on every case in turn, plus the references:
the undamaged backups without the newest (a resume from step 6) and no
backup (a fresh start). Each damaged case must finish with the weights of
its reference, after one line of the chief naming what was set aside.
"""

import os
import re
import shutil
import struct
import sys

import numpy as np
import pytest

from tests.conftest import launch_workers
from tfdp.checkpoint.format import layout as layout_lib

WORKER = "tests/workers/corrupt_fit.py"
NEWEST, OLDER = "ckpt-9", "ckpt-6"


def _varint(buf, pos):
  value = shift = 0
  while True:
    b = buf[pos]
    pos += 1
    value |= (b & 0x7F) << shift
    shift += 7
    if b < 0x80:
      return value, pos


def _block(data, offset, size):
  """(key, value) of a table block of TF's index (LevelDB's format: shared key prefixes, restarts at the end)."""
  block = data[offset:offset + size]
  restarts = struct.unpack("<I", block[-4:])[0]
  end, pos, key, out = len(block) - 4 - 4 * restarts, 0, b"", []
  while pos < end:
    shared, pos = _varint(block, pos)
    unshared, pos = _varint(block, pos)
    length, pos = _varint(block, pos)
    key = key[:shared] + block[pos:pos + unshared]
    pos += unshared
    out.append((key, block[pos:pos + length]))
    pos += length
  return out


def tensor_spans(prefix):
  """{key: (data file, offset, size)} of checkpoint `prefix`, read from its index."""
  from tensorflow.core.protobuf import tensor_bundle_pb2  # pylint: disable=g-import-not-at-top
  data = open(layout_lib.index_path(prefix), "rb").read()
  footer = data[-48:]
  _, pos = _varint(footer, 0)
  _, pos = _varint(footer, pos)
  index_offset, pos = _varint(footer, pos)
  index_size, pos = _varint(footer, pos)
  spans, shards = {}, None
  for _, handle in _block(data, index_offset, index_size):
    offset, p = _varint(handle, 0)
    size, _ = _varint(handle, p)
    for key, value in _block(data, offset, size):
      if key == b"":
        shards = tensor_bundle_pb2.BundleHeaderProto.FromString(value).num_shards
        continue
      e = tensor_bundle_pb2.BundleEntryProto.FromString(value)
      spans[key.decode()] = (layout_lib.data_filename(prefix, e.shard_id, shards), e.offset,
                             e.size)
  return spans


def flip(path, offset):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))


def flip_tensor(prefix, pattern):
  """Flips the middle byte of the first tensor whose key matches `pattern`; returns its data file."""
  spans = tensor_spans(prefix)
  key = next(k for k in sorted(spans) if re.search(pattern, k))
  path, offset, size = spans[key]
  flip(path, offset + size // 2)
  return path


def _middle(path):
  flip(path, os.path.getsize(path) // 2)
  return path


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)
  return path


PER_WORKER = layout_lib.PER_WORKER_ROOT
# case -> damage of the newest backup (returns the file a line must name).
DAMAGE = {
    "variables": lambda p: flip_tensor(p, r"^model/.*kernel"),
    "data": lambda p: flip_tensor(p, rf"^{PER_WORKER}/0/data/.*state"),
    "callbacks": lambda p: flip_tensor(p, rf"^{PER_WORKER}/1/callbacks/.*state"),
    "index": lambda p: _middle(layout_lib.index_path(p)),
    "manifest": lambda p: _middle(layout_lib.manifest_path(p)),
    "truncated": lambda p: _truncate(layout_lib.data_filename(p, 1, 2)),
    # No older backup: a fresh start (an optimizer slot, as in the issue).
    "scratch": lambda p: flip_tensor(p, r"^optimizer/.*"),
}
REFERENCE = {case: "ref-older" for case in DAMAGE} | {"scratch": "ref-scratch"}


def _remove(directory, base):
  for f in os.listdir(directory):
    if f.startswith(base + "."):
      os.remove(os.path.join(directory, f))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("corrupt"))
  code, out = launch_workers([sys.executable, WORKER, root, "prepare"])
  assert code == 0, out[-3000:]
  made = os.path.join(root, "prepare", "backup")
  assert {f for f in os.listdir(made) if f.endswith(".manifest.json")} == {
      NEWEST + ".manifest.json", OLDER + ".manifest.json"}
  named = {}
  for case in ["ref-older", "ref-scratch"] + list(DAMAGE):
    d = os.path.join(root, case, "backup")
    os.makedirs(os.path.dirname(d))
    if case == "ref-scratch":
      continue
    shutil.copytree(made, d)
    if case == "ref-older":
      _remove(d, NEWEST)
      continue
    if case == "scratch":
      _remove(d, OLDER)
    named[case] = DAMAGE[case](os.path.join(d, NEWEST))
  cases = ["ref-older", "ref-scratch"] + list(DAMAGE)
  code, out = launch_workers([sys.executable, WORKER, root, ",".join(cases)], timeout=600)
  assert code == 0, out[-5000:]
  # What worker 0 (the chief) said during each case.
  said = {}
  for part in re.split(r"^\[worker 0\] CASE ", out, flags=re.M)[1:]:
    name, _, text = part.partition("\n")
    said[name] = "\n".join(l for l in text.splitlines() if l.startswith("[worker 0]"))
  return root, named, said, out, made


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_newest_backup_is_set_aside_and_the_same_run_goes_on(runs, case):
  root, named, said, out, _ = runs
  text = said[case]
  reference = REFERENCE[case]
  want = "restored=6" if reference == "ref-older" else "restored=None"
  assert f"RESULT case={case} worker=0 steps=16 {want}" in text, text[-3000:]
  assert f"RESULT case={case} worker=1 steps=16 {want}" in out
  # One line of the chief names what was set aside, and why (the damaged file,
  # when the chief found it; else the workers that did).
  lines = [l for l in text.splitlines() if "tfdp: restore: tried" in l]
  assert len(lines) == 1, text[-3000:]
  assert f"{NEWEST} (set aside: " in lines[0], lines[0]
  assert (named[case] in lines[0] or "worker(s) [1] found it damaged" in lines[0]), lines[0]
  assert ("a fresh start" in lines[0]) == (case == "scratch"), lines[0]
  backup = os.path.join(root, case, "backup")
  assert os.path.exists(os.path.join(backup, NEWEST + ".manifest.json.corrupt"))
  for worker in range(2):
    got = np.load(os.path.join(root, case, f"weights-{worker}.npy"))
    ref = np.load(os.path.join(root, reference, f"weights-{worker}.npy"))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
def test_a_backup_of_another_model_stops_the_job_with_one_line(runs, tmp_path):
  """Every worker refuses it before assigning anything; the launcher's line names the backup and the difference."""
  made = runs[-1]
  d = str(tmp_path / "wider" / "backup")
  shutil.copytree(made, d)
  code, out = launch_workers([sys.executable, WORKER, str(tmp_path), "wider"])
  assert code == 2, out[-3000:]  # A usage error: tfdp-launch does not restart it.
  lines = [l for l in out.splitlines() if re.match(r"\[tfdp-launch\] workers? 0(,1)? failed: ", l)]
  assert len(lines) == 1, out[-3000:]
  assert "IncompatibleCheckpointError: " in lines[0] and d in lines[0], lines[0]
  assert "mlp/hidden/kernel is float32 [6, 16] in it, float32 [6, 17] here" in lines[0], lines[0]
  assert os.path.exists(os.path.join(d, NEWEST + ".manifest.json"))  # Not set aside.
