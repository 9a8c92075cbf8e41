"""Tests of tfdp-ckpt as a command-line tool: `ls` without TensorFlow, `inspect`'s summary and table, no TF start-up lines."""

import io
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import units
from tfdp.cli import ckpt
from tests.conftest import REPO, users_environ

PY = sys.executable


def _cli(*argv):
  out, err = io.StringIO(), io.StringIO()
  code = ckpt.main([str(a) for a in argv], out=out, err=err)
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """A Keras fit's backup (tfdp, at step 11: epoch 2, step 3 of it), and TF's own checkpoints."""
  root = tmp_path_factory.mktemp("ckpt_cli")
  x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
  y = (x.sum(axis=1) > 0).astype("int32")
  strategy = tfdp.make_strategy()
  with strategy.scope():
    # Named: Keras numbers unnamed layers by how many came before them in this process.
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(256, activation="relu",
                                                                    name="dense"),
                              keras.layers.Dense(2, name="dense_1")], name="sequential")
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  backup = tfdp.callbacks.BackupAndRestore(str(root / "backup"), save_freq=11,
                                           delete_checkpoint=False)
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0,
            callbacks=[backup])
  state = tf.train.Checkpoint(w=tf.Variable(np.zeros((100, 10), np.float32)), step=tf.Variable(7))
  manager = tf.train.CheckpointManager(state, str(root / "tf"), max_to_keep=3)
  manager.save()
  manager.save()
  return {"backup": str(root / "backup"), "tf": str(root / "tf")}


def _copy(dirs, dest):
  """A copy of the backup's ckpt-11 in `dest`, without TF's state file."""
  dest.mkdir()
  for name in os.listdir(dirs["backup"]):
    if name.startswith("ckpt-11."):
      shutil.copy(os.path.join(dirs["backup"], name), dest / name)
  return dest


def _rows(out):
  return [line.split() for line in out.splitlines()[1:]]


def test_ls_of_a_tfdp_directory(dirs):
  code, out, err = _cli("ls", dirs["backup"])
  assert (code, err) == (0, ""), err
  assert out.splitlines()[0].split() == ["CHECKPOINT", "STEP", "SIZE", "SHARDS", "WORLD", "STATUS"]
  [row] = _rows(out)
  assert row[:2] == ["ckpt-11", "11"] and row[3] == "KB" and row[4:7] == ["1", "1", "sizes"], out
  assert out.splitlines()[1].endswith("sizes ok (bytes not read: --verify) (latest)"), out


def test_ls_of_tf_checkpoints_a_torn_save_and_a_damaged_one(dirs, tmp_path):
  code, out, _ = _cli("ls", dirs["tf"])
  assert code == 0
  rows = [" ".join(r) for r in _rows(out)]
  size = sum(os.path.getsize(os.path.join(dirs["tf"], f)) for f in os.listdir(dirs["tf"])
             if f.startswith("ckpt-2."))
  assert rows == [f"ckpt-1 - {units.human_bytes(size)} 1 - TF checkpoint (no tfdp manifest; files "
                  "not checked)",
                  f"ckpt-2 - {units.human_bytes(size)} 1 - TF checkpoint (no tfdp manifest; files "
                  "not checked) (latest)"], out
  # A save that never committed (not in TF's state file), and a truncated shard.
  d = _copy(dirs, tmp_path / "copy")
  (d / "ckpt-12.index").write_bytes(b"torn")
  data = d / "ckpt-11.data-00000-of-00001"
  os.truncate(data, 100)
  code, out, _ = _cli("ls", d)
  assert code == 0
  assert re.search(rf"^ckpt-11 +11 .* CORRUPT: {re.escape(str(data))}: size 100 bytes, manifest "
                   r"says \d+ \(truncated or overwritten\)$", out, re.M), out
  assert re.search(r"^ckpt-12 +- +4 B +- +- +no tfdp manifest \(written by TF itself, or a torn "
                   r"save\)$", out, re.M), out


def test_ls_says_what_it_checked_and_verify_reads_the_bytes(dirs, tmp_path):
  """A flipped byte: `ls` says only that the sizes are right, never "intact"; --verify and `verify` find it."""
  assert "verified (every byte) (latest)" in _cli("ls", dirs["backup"], "--verify")[1]
  d = _copy(dirs, tmp_path / "flipped")
  data = d / "ckpt-11.data-00000-of-00001"
  raw = bytearray(data.read_bytes())
  raw[200] ^= 0xFF
  data.write_bytes(bytes(raw))
  out = _cli("ls", d)[1]
  assert "sizes ok (bytes not read: --verify)" in out and "intact" not in out, out  # same sizes
  for flag in ("--verify", "--checksums"):
    code, out, _ = _cli("ls", d, flag)
    assert code == 0 and "CORRUPT" in out and "CRC32C" in out, out
  code, out, _ = _cli("verify", str(d / "ckpt-11"))
  assert code == 1 and "BAD" in out, out
  # A manifest of a newer tfdp is a row of its own; the others are still listed (review of the house).
  man = d / "ckpt-11.manifest.json"
  man.write_text(man.read_text().replace('"manifest_version": 4', '"manifest_version": 99'))
  code, out, _ = _cli("ls", d)
  assert code == 0 and "unreadable manifest: Manifest version 99" in out and "ckpt-" in out, out


def test_inspect_summarizes_then_lists_the_users_variables(dirs):
  prefix = os.path.join(dirs["backup"], "ckpt-11")
  code, out, err = _cli("inspect", prefix)
  assert (code, err) == (0, ""), err
  summary, table = out.split("\n\n")
  labels = dict(re.match(r"(\S+(?: \S+)?) +(.*)", line).groups() for line in summary.splitlines())
  assert labels["checkpoint"] == f"{prefix} (tfdp, manifest version {manifest_lib.MANIFEST_VERSION})"
  # 8 batches an epoch: step 11 is the 3rd step of the 2nd epoch.
  assert labels["step"] == "11 (epoch 2, step 3 of it)"
  assert labels["world size"] == "1 worker"
  assert labels["tier"] == "persistent"
  assert re.fullmatch(r"worker 0: [\d.]+ (B|KB); data positions of 1 worker\(s\) x 1 "
                      r"replica\(s\)", labels["per-worker"]), summary
  assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d by tfdp \S+, tensorflow \S+, keras \S+",
                      labels["saved"]), summary
  # The metrics of the epoch they come from (the backup is in the next one).
  assert re.fullmatch(r"epoch 1: loss [\d.]+", labels["metrics"]), summary
  assert re.fullmatch(r"worker 0: [\d.]+ (B|KB) \(\d+% of the checkpoint's [\d.]+ KB\)",
                      labels["data position"]), summary
  lines = table.splitlines()
  assert lines[0].split() == ["VARIABLE", "SHAPE", "DTYPE", "SIZE"]
  names = [l.split()[0] for l in lines[1:-1]]
  assert "model/sequential/dense/kernel" in names and "optimizer/iteration" in names, table
  assert names == sorted(names) and names[0].startswith("model/"), names  # model, then optimizer
  assert re.search(r"^model/sequential/dense/kernel +\[8, 256\] +float32 +8\.2 KB$", table, re.M)
  assert ".ATTRIBUTES" not in out and "_CHECKPOINTABLE_OBJECT_GRAPH" not in out
  assert re.fullmatch(r"14 tensors, [\d.]+ KB \(model [\d.]+ KB, optimizer [\d.]+ KB\); 14 internal "
                      r"entries .* not listed: --all lists them", lines[-1]), lines[-1]


def test_inspect_all_lists_the_internal_entries_last(dirs):
  code, out, _ = _cli("inspect", os.path.join(dirs["backup"], "ckpt-11"), "--all")
  assert code == 0
  names = [l.split()[0] for l in out.split("\n\n")[1].splitlines()[1:-1]]
  assert len(names) == 28 and names[:14] == sorted(names[:14]), names
  assert set(names[14:]) == {
      "_CHECKPOINTABLE_OBJECT_GRAPH", "_tfdp_per_worker/0/callbacks/.ATTRIBUTES/arrays",
      "_tfdp_per_worker/0/callbacks/.ATTRIBUTES/state",
      "_tfdp_per_worker/0/metrics/.ATTRIBUTES/state", "keras_model/.ATTRIBUTES/py_state",
      "_tfdp_per_worker/0/data/.ATTRIBUTES/kind",
      "_tfdp_per_worker/0/data/.ATTRIBUTES/made", "_tfdp_per_worker/0/data/.ATTRIBUTES/skip",
      "_tfdp_per_worker/0/data/.ATTRIBUTES/state",
      "data_topology", "keras_epoch", "keras_step_in_epoch", "run_config/.ATTRIBUTES/py_state",
      "save_counter"}, names
  assert "not listed" not in out


def test_inspect_of_tfs_own_checkpoint(dirs):
  code, out, _ = _cli("inspect", os.path.join(dirs["tf"], "ckpt-2"))
  assert code == 0
  summary, table = out.split("\n\n")
  assert summary == f"checkpoint  {os.path.join(dirs['tf'], 'ckpt-2')} (no tfdp manifest: TF's own format)"
  assert re.search(r"^w +\[100, 10\] +float32 +4\.0 KB$", table, re.M), table
  assert re.search(r"^step +\[\] +int32 +4 B$", table, re.M), table


def test_sizes_in_human_units():
  assert [units.human_bytes(n) for n in (0, 999, 1000, 1_234_567, 5 * 10**9)] == [
      "0 B", "999 B", "1.0 KB", "1.2 MB", "5.0 GB"]


# A process in which `import tensorflow` fails: a finder first in sys.meta_path refuses it.
_NO_TF = """
import sys
class _NoTF:
  def find_spec(self, name, path=None, target=None):
    if name == "tensorflow" or name.startswith("tensorflow."):
      raise ImportError("TensorFlow is unimportable in this test")
sys.meta_path.insert(0, _NoTF())
sys.argv = ["tfdp-ckpt"] + sys.argv[1:]
from tfdp.cli import ckpt
sys.exit(ckpt.main(sys.argv[1:]))
"""


def test_ls_runs_where_tensorflow_cannot_be_imported(dirs, tmp_path):
  """`tfdp-ckpt ls` reads the restore's records and checks the sizes as it does, with no TensorFlow at all.

  `ls --verify` needs TensorFlow: each tensor's CRC32C is checked by TF's
  bundle reader, as the restore reads it.
  """
  def ls(*argv):
    return subprocess.run([PY, "-c", _NO_TF, "ls", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)

  proc = ls(dirs["backup"])
  assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
  assert proc.stdout == _cli("ls", dirs["backup"])[1], proc.stdout
  assert proc.stdout.splitlines()[1].endswith("sizes ok (bytes not read: --verify) (latest)")
  d = _copy(dirs, tmp_path / "truncated")
  os.truncate(d / "ckpt-11.data-00000-of-00001", 100)
  proc = ls(d)
  assert proc.returncode == 0 and "CORRUPT: " in proc.stdout and "size 100 bytes" in proc.stdout, (
      proc.stdout + proc.stderr)
  proc = ls(dirs["tf"])  # TF's own checkpoints: its state file read without TF.
  assert proc.returncode == 0 and proc.stdout.count("TF checkpoint") == 2, proc.stdout + proc.stderr
  assert proc.stdout.splitlines()[-1].endswith("(latest)"), proc.stdout


def test_no_tf_start_up_lines_on_stderr(dirs):
  # TF's defaults: every start-up line it logs (oneDNN's too, off in conftest.py).
  env = users_environ(os.environ)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  proc = subprocess.run([PY, "-m", "tfdp.cli.ckpt", "inspect", os.path.join(dirs["backup"],
                                                                              "ckpt-11")],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == "", proc.stderr
  assert proc.stdout.startswith("checkpoint  ")


def test_stderr_other_than_tf_start_up_is_written_back(capfd):
  with ckpt._tf_start_up_hidden():  # pylint: disable=protected-access
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written "
                b"to STDERR\n"
                b"I0000 00:00:1796133538.349871   25316 cudart_stub.cc:31] Could not find cuda "
                b"drivers on your machine, GPU will not be used.\n"
                b"E0000 00:00:1796133538.349871   25316 some_op.cc:12] a real error\n")
    os.write(2, b"a warning of Python's\n")
  err = capfd.readouterr().err
  assert err == ("E0000 00:00:1796133538.349871   25316 some_op.cc:12] a real error\n"
                 "a warning of Python's\n"), err
