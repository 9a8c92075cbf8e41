"""Tests of tfdp.checkpoint and tfdp-ckpt on real disks with real worker processes."""

import io
import json
import re
import os
import shutil
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import safetensors.numpy
import tensorflow as tf

from tfdp import errors
from tfdp import launch
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.persistent import retention
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import planner
from tfdp.cli import ckpt as ckpt_cli

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "ckpt_worker.py")
sys.path.insert(0, os.path.join(HERE, "workers"))
import ckpt_worker  # pylint: disable=g-import-not-at-top,wrong-import-position

CRASH_PHASES = [("before_shard", 1), ("after_shard", 1), ("after_marker", 1),
                ("during_commit", 0), ("after_commit", 0)]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  env.pop("TFDP_CKPT_TEST_CRASH_AT", None)
  return env


def _launch(args, num_workers, log_path):
  with open(log_path, "w") as log:
    return launch.launch([sys.executable, WORKER] + args, num_workers,
                         env=_env(), out=log)


def _cli(*argv):
  code, out, _ = _cli_err(*argv)
  return code, out


def _cli_err(*argv):
  out, err = io.StringIO(), io.StringIO()
  code = ckpt_cli.main(list(argv), out=out, err=err)
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Runs every multi-process scenario once; tests assert on the results."""
  root = str(tmp_path_factory.mktemp("ckpt"))
  r = {"root": root}
  # A 1-worker checkpoint, written here, for the 1 -> 2 restore.
  c_values = ckpt_worker.values(7)
  model = ckpt_worker.make_state(c_values)
  with CheckpointManager(tf.train.Checkpoint(model=model),
                         os.path.join(root, "c")) as m:
    m.save()  # Released on exit: the job below reads this directory.
  np.savez(os.path.join(root, "c_values.npz"), **c_values)

  # 2 workers under MWMS: restore the 1-worker checkpoint, then save.
  out_a = os.path.join(root, "out_a")
  os.makedirs(out_a)
  r["a_code"] = _launch(
      ["mwms", f"--dir={root}/a", f"--out={out_a}", "--seed=2",
       f"--restore_from={root}/c", f"--expect={root}/c_values.npz"],
      2, os.path.join(root, "a.log"))
  # 3 workers: restore the 2-worker checkpoint, then save (files capped at 1MB).
  out_b = os.path.join(root, "out_b")
  os.makedirs(out_b)
  r["b_code"] = _launch(
      ["mwms", f"--dir={root}/b", f"--out={out_b}", "--seed=3",
       f"--restore_from={root}/a", f"--expect={out_a}/sync_values.npz",
       "--max_shard_bytes=1000000"],
      3, os.path.join(root, "b.log"))

  # In parallel: 3-worker checkpoint -> MirroredStrategy with 3 replicas, and
  # one 2-worker job per crash phase.
  results = {}

  def mirrored():
    p = subprocess.run(
        [sys.executable, WORKER, "mirrored", f"--restore_from={root}/b",
         f"--expect={out_b}/sync_values.npz"], env=_env(),
        capture_output=True, text=True, timeout=180)
    results["mirrored"] = p

  def outside():
    d = os.path.join(root, "outside")
    os.makedirs(d + "_out")
    results["outside"] = _launch(["outside", f"--dir={d}", f"--out={d}_out", "--seed=5"],
                                 2, d + ".log")

  def crash(phase, worker):
    d = os.path.join(root, f"crash_{phase}")
    results[phase] = _launch(
        ["crash", f"--dir={d}", f"--run_id={uuid.uuid4().hex}",
         f"--crash_at={phase}:{worker}", "--timeout=60"], 2, d + ".log")

  threads = [threading.Thread(target=mirrored), threading.Thread(target=outside)] + [
      threading.Thread(target=crash, args=pw) for pw in CRASH_PHASES]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  r.update(results)
  r["res_a"] = [json.load(open(f"{out_a}/result-w{i}.json")) for i in range(2)]
  r["res_b"] = [json.load(open(f"{out_b}/result-w{i}.json")) for i in range(3)]
  return r


def _log(runs, name):
  with open(os.path.join(runs["root"], name)) as f:
    return f.read()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("run,n", [("a", 2), ("b", 3)])
def test_sharded_save_writes_1x_state_and_every_worker_writes(runs, run, n):
  assert runs[f"{run}_code"] == 0, _log(runs, f"{run}.log")
  prefix = os.path.join(runs["root"], run, "ckpt-1")
  man = manifest_lib.read_manifest(prefix)
  assert man.world_size == n and man.global_batch_size == 32
  state = ckpt_worker.state_bytes()
  written = [man.writers[str(i)]["bytes_written"] for i in range(n)]
  assert all(w > 0 for w in written), written
  assert sum(written) <= 1.1 * state, (written, state)
  # Nothing else on disk: no per-worker throw-away copies, no temp dirs left.
  on_disk = sum(os.path.getsize(os.path.join(dp, f))
                for dp, _, fs in os.walk(os.path.dirname(prefix)) for f in fs)
  assert on_disk <= 1.1 * state
  if run == "b":  # max_shard_bytes=1MB splits each worker's part; a bigger
    # single tensor (w0, w1: 1048576 bytes) gets a file of its own.
    assert man.num_shards > n
    assert all(f.size <= 1_048_576 for f in man.files)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["a", "b"])
def test_all_workers_agree_on_latest(runs, run):
  latest = {r["latest_after_sync"] for r in runs[f"res_{run}"]}
  assert latest == {os.path.join(runs["root"], run, "ckpt-1")}


@pytest.mark.slow
def test_plain_tf_reads_it_and_restores_2_to_1(runs):
  prefix = os.path.join(runs["root"], "a", "ckpt-1")
  assert tf.train.latest_checkpoint(os.path.dirname(prefix)) == prefix
  keys = dict(tf.train.list_variables(prefix))
  assert keys["model/w0/.ATTRIBUTES/VARIABLE_VALUE"] == [512, 512]
  reader = tf.train.load_checkpoint(prefix)
  expected = dict(np.load(os.path.join(runs["root"], "out_a",
                                       "sync_values.npz")))
  np.testing.assert_array_equal(
      reader.get_tensor("model/w1/.ATTRIBUTES/VARIABLE_VALUE"), expected["w1"])
  model = ckpt_worker.make_state(None)
  tf.train.Checkpoint(model=model).restore(prefix).assert_existing_objects_matched()
  assert ckpt_worker.same(ckpt_worker.read(model), expected)


@pytest.mark.slow
def test_restore_1_to_2_and_2_to_3_identical(runs):
  for r in runs["res_a"] + runs["res_b"]:
    assert r["restored_ok"], r
  # Per-worker state: the 2 writers' own values; worker 2 has none to restore.
  assert [r["restored_pos"] for r in runs["res_b"]] == [100, 101, -1]


@pytest.mark.slow
def test_restore_3_workers_into_mirrored_3_replicas(runs):
  p = runs["mirrored"]
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  assert '"replicas": 3' in p.stdout


@pytest.mark.slow
def test_async_save_returns_early_and_snapshots(runs):
  prefix = os.path.join(runs["root"], "a_async", "ckpt-1")
  man = manifest_lib.read_manifest(prefix)
  for r in runs["res_a"]:
    assert r["async_latest"] == prefix
    assert r["async_returned"] < man.time
  assert any(r["async_running_after_return"] for r in runs["res_a"])
  model = ckpt_worker.make_state(None)
  tf.train.Checkpoint(model=model).restore(prefix).assert_existing_objects_matched()
  expected = dict(np.load(os.path.join(runs["root"], "out_a",
                                       "async_values.npz")))
  assert ckpt_worker.same(ckpt_worker.read(model), expected)
  assert not ckpt_worker.same(ckpt_worker.read(model), ckpt_worker.values(1002))


@pytest.mark.slow
@pytest.mark.parametrize("phase,worker", CRASH_PHASES)
def test_sigkill_at_each_phase_leaves_intact_latest(runs, phase, worker):
  assert runs[phase] != 0  # the killed worker fails the job
  d = os.path.join(runs["root"], f"crash_{phase}")
  log = _log(runs, f"crash_{phase}.log")
  assert "killing worker" in log, log
  mgr = CheckpointManager(tf.train.Checkpoint(model=ckpt_worker.make_state(None)),
                          d)  # Cleans leftovers of the torn save.
  want = "ckpt-2" if phase == "after_commit" else "ckpt-1"
  if phase == "after_marker":
    # Worker 1's part was complete: the chief may commit before the launcher
    # stops it, or be stopped first. Either way the latest is intact.
    want = os.path.basename(mgr.latest_checkpoint)
    assert want in ("ckpt-1", "ckpt-2")
  assert mgr.latest_checkpoint == os.path.join(d, want)
  code, out = _cli("verify", mgr.latest_checkpoint)
  assert code == 0, out
  assert not os.listdir(os.path.join(d, layout_lib.TMP_DIRNAME))
  committed = {f.split(".")[0] for f in os.listdir(d) if f.startswith("ckpt-")}
  assert committed == {"ckpt-1", want}
  mgr.restore_or_initialize()
  expected = ckpt_worker.values(1 if want == "ckpt-1" else 2)
  assert ckpt_worker.same(ckpt_worker.read(mgr.checkpoint.model), expected)


@pytest.mark.slow
def test_manager_outside_scope_without_strategy_shares_one_checkpoint(runs):
  """The TF-tutorial way under 2 workers: 1x the state per save, both write, TF reads it."""
  assert runs["outside"] == 0, _log(runs, "outside.log")
  d = os.path.join(runs["root"], "outside")
  res = [json.load(open(os.path.join(d + "_out", f"outside-w{i}.json"))) for i in range(2)]
  assert [(r["worker"], r["num_workers"]) for r in res] == [(0, 2), (1, 2)]
  want = [os.path.join(d, f"ckpt-{i}") for i in (2, 3)]
  assert res[0]["checkpoints"] == res[1]["checkpoints"] == want
  man = manifest_lib.read_manifest(want[-1])
  written = [man.writers[str(i)]["bytes_written"] for i in range(2)]
  assert man.world_size == 2 and all(w > 0 for w in written), written
  assert sum(written) <= 1.1 * ckpt_worker.state_bytes()
  assert sorted({f.split(".")[0] for f in os.listdir(d) if f.startswith("ckpt-")}) == [
      "ckpt-2", "ckpt-3"]
  model = ckpt_worker.make_state(None)
  tf.train.Checkpoint(model=model).restore(want[-1]).assert_existing_objects_matched()
  assert ckpt_worker.same(ckpt_worker.read(model), ckpt_worker.values(7))


def _copy(runs, name):
  src = os.path.join(runs["root"], "a")
  dst = os.path.join(runs["root"], name)
  shutil.copytree(src, dst)
  return os.path.join(dst, "ckpt-1")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_caught_by_verify_and_restore(runs, damage):
  prefix = _copy(runs, f"damaged_{damage}")
  bad = prefix + ".data-00001-of-00002"
  with open(bad, "r+b") as f:
    if damage == "flip":
      f.seek(1000)
      b = f.read(1)
      f.seek(1000)
      f.write(bytes([b[0] ^ 0xFF]))
    else:
      f.truncate(1000)
  code, out = _cli("verify", prefix)
  assert code != 0 and bad in out
  mgr = CheckpointManager(tf.train.Checkpoint(model=ckpt_worker.make_state(None)),
                          os.path.dirname(prefix))
  with pytest.raises(errors.CorruptCheckpointError, match=bad):
    mgr.restore(prefix)


def test_restore_or_initialize_falls_back_to_newest_intact(tmp_path):
  model = ckpt_worker.make_state(ckpt_worker.values(1))
  mgr = CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path))
  mgr.save()
  ckpt_worker.assign(model, ckpt_worker.values(2))
  second = mgr.save()
  with open(second + ".index", "r+b") as f:
    f.truncate(10)
  fresh = ckpt_worker.make_state(None)
  mgr2 = CheckpointManager(tf.train.Checkpoint(model=fresh), str(tmp_path))
  assert mgr2.restore_or_initialize() == str(tmp_path / "ckpt-1")
  assert ckpt_worker.same(ckpt_worker.read(fresh), ckpt_worker.values(1))
  # The corrupt one is set aside, so training goes on from ckpt-1 and saves
  # ckpt-2 again, and a restart does not trip over it.
  assert mgr2.checkpoints == [str(tmp_path / "ckpt-1")]
  assert os.path.exists(second + ".manifest.json.corrupt")
  assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-1")
  ckpt_worker.assign(fresh, ckpt_worker.values(3))
  assert mgr2.save(checkpoint_number=2) == second
  mgr3 = CheckpointManager(tf.train.Checkpoint(model=ckpt_worker.make_state(None)),
                           str(tmp_path))
  assert mgr3.restore_or_initialize() == second
  assert ckpt_worker.same(ckpt_worker.read(mgr3.checkpoint.model),
                          ckpt_worker.values(3))


def test_a_worker_writes_big_state_as_parallel_files(tmp_path, monkeypatch):
  # Each file must hold >= PARALLEL_MIN_FILE_BYTES; lowered so 12 small
  # variables make 3 files, written at once by 3 threads.
  monkeypatch.setattr(planner, "PARALLEL_MIN_FILE_BYTES", 1000)
  monkeypatch.setattr(planner, "PARALLEL_FILES", 3)
  rng = np.random.default_rng(0)
  vals = [rng.standard_normal(250 + 50 * i).astype(np.float32) for i in range(12)]
  vs = [tf.Variable(v) for v in vals]
  mgr = CheckpointManager(tf.train.Checkpoint(vs=vs), str(tmp_path))
  prefix = mgr.save()
  man = manifest_lib.read_manifest(prefix)
  data = [f for f in man.files if ".data-" in f.name]
  assert len(data) == 3 and man.num_shards == 3
  sizes = [f.size for f in data]
  assert max(sizes) < 1.3 * min(sizes), sizes  # balanced by bytes
  keys = [k for f in data for k in f.tensors]
  assert len(keys) == len(set(keys)) == 14  # 12 variables, save_counter, object graph
  code, out = _cli("verify", prefix)
  assert code == 0, out
  for v in vs:
    v.assign(tf.zeros_like(v))
  mgr.restore(prefix)
  for v, want in zip(vs, vals):
    np.testing.assert_array_equal(v.numpy(), want)


def test_async_error_surfaces_in_training_thread(tmp_path):
  v = tf.Variable(1.0)
  mgr = CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path),
                          async_save=True)
  # A file where the temp dir must go makes the background write fail.
  (tmp_path / layout_lib.TMP_DIRNAME).write_text("in the way")
  mgr.save()
  with pytest.raises(Exception):
    mgr.wait_until_finished()
  mgr.wait_until_finished()  # raised once, not lost, not repeated
  assert mgr.latest_checkpoint is None


def test_retention_keep_last_hours_best(tmp_path):
  e = [retention.Entry(f"c{i}", i, 1800.0 * i, {"loss": l})
       for i, l in enumerate([5.0, 1.0, 4.0, 3.0, 2.0, 6.0])]
  assert retention.KeepLatest(2).keeps(e) == {"c4", "c5"}
  # Fewer checkpoints than max_to_keep: all stay.
  assert retention.KeepLatest(5).keeps(e[:3]) == {"c0", "c1", "c2"}
  # Hours (TF's rule): of what max_to_keep lets go, one per hour counted
  # from the last preserved time; the first is not kept forever.
  hours = retention.sweep(e, retention.KeepLatest(1), retention.KeepEveryNHours(1.0), -1.0)
  assert [x.prefix for x in hours.preserved] == ["c2", "c4"]
  assert [x.prefix for x in hours.deleted] == ["c0", "c1", "c3"]
  assert hours.last_preserved == e[4].time
  assert retention.KeepBest("loss", "min", 2).keeps(e) == {"c1", "c4"}
  assert retention.KeepBest("loss", "max", 1).keeps(e) == {"c5"}
  both = retention.AnyOf((retention.KeepLatest(1), retention.parse_keep_best(("loss", "min", 1))))
  kept = retention.sweep(e, both, retention.KeepEveryNHours(None), 0.0).kept
  assert {x.prefix for x in kept} == {"c1", "c5"}
  with pytest.raises(errors.ConfigError):
    retention.parse_keep_best(("loss", "median", 1))
  # Through the manager: best-by-metric survives max_to_keep; files deleted.
  v = tf.Variable(0.0)
  mgr = CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path),
                          max_to_keep=2, keep_best=("loss", "min", 1))
  for loss in [3.0, 1.0, 2.0, 4.0, 5.0]:
    mgr.save(metrics={"loss": loss})
  names = [os.path.basename(p) for p in mgr.checkpoints]
  assert names == ["ckpt-2", "ckpt-4", "ckpt-5"]
  # Dropped checkpoints are gone when a synchronous save returns (as TF's).
  assert sorted(f[:-len(".manifest.json")] for f in os.listdir(tmp_path)
                if f.endswith(".manifest.json")) == names
  assert sorted({f.split(".")[0] for f in os.listdir(tmp_path)
                 if f.startswith("ckpt-")}) == names
  with pytest.raises(errors.CheckpointError, match="already exists"):
    mgr.save(checkpoint_number=4)
  # The newest again: without a step_counter nothing tells a repeat of its state
  # from a changed one, so it is refused too (with one, its path: test_manager_parity).
  with pytest.raises(errors.CheckpointError, match="already exists.*step_counter"):
    mgr.save(checkpoint_number=5)
  # A lower number would be dropped at once and resumed from by nobody.
  with pytest.raises(errors.CheckpointError, match="would be older than ckpt-5"):
    mgr.save(checkpoint_number=3)
  assert os.path.basename(mgr.save(checkpoint_number=9)) == "ckpt-9"


@pytest.mark.slow
def test_cli_ls_inspect_export(runs, tmp_path):
  d = os.path.join(runs["root"], "a")
  code, out = _cli("ls", d, "--checksums")
  assert code == 0 and "ckpt-1" in out and "verified (every byte)" in out
  code, out = _cli("inspect", d + "/ckpt-1")
  assert code == 0
  assert re.search(r"^model/w0 +\[512, 512\] +float32 +1\.0 MB$", out, re.M), out
  code, out = _cli("export", d + "/ckpt-1", str(tmp_path), "--format",
                   "safetensors", "--max_shard_size=1.5MB")
  assert code == 0, out
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  loaded = {}
  for f in files:
    loaded.update(safetensors.numpy.load_file(tmp_path / f))
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in loaded.values())
  expected = dict(np.load(os.path.join(runs["root"], "out_a",
                                       "sync_values.npz")))
  # Named by the variables' paths under `model` (Keras paths, for a TrainState).
  assert sorted(loaded) == sorted(index["weight_map"]) == sorted(ckpt_worker.SPECS)
  for name in ckpt_worker.SPECS:
    np.testing.assert_array_equal(loaded[name], expected[name])


@pytest.mark.slow
def test_cli_bad_paths_and_damaged_checkpoints_are_one_line_exit_2(runs, tmp_path):
  no_index = _copy(runs, "cli_no_index")
  os.remove(no_index + ".index")
  code, out, err = _cli_err("inspect", no_index)
  assert (code, out, err.count("\n")) == (2, "", 1) and "ckpt-1.index" in err, err
  truncated = _copy(runs, "cli_truncated")
  with open(truncated + ".data-00001-of-00002", "r+b") as f:
    f.truncate(1000)
  dest = tmp_path / "export"
  code, out, err = _cli_err("export", truncated, str(dest))
  assert (code, err.count("\n")) == (2, 1) and "data-00001-of-00002" in err, err
  assert not dest.exists()  # No empty output folder left behind.
  for argv in (("ls", truncated + ".index"), ("verify", str(tmp_path / "nothing")),
               ("inspect", os.path.dirname(truncated)),
               ("export", os.path.join(runs["root"], "a", "ckpt-1"), truncated + ".index")):
    code, out, err = _cli_err(*argv)
    assert (code, out, err.count("\n")) == (2, "", 1), (argv, err)
  # An earlier export is replaced only with --overwrite, stale shards removed.
  good = os.path.join(runs["root"], "a", "ckpt-1")
  again = tmp_path / "again"
  assert _cli("export", good, str(again))[0] == 0
  (again / "model-00009-of-00009.safetensors").write_bytes(b"stale")
  code, _, err = _cli_err("export", good, str(again))
  assert code == 2 and "--overwrite" in err
  assert _cli("export", good, str(again), "--overwrite")[0] == 0
  assert not (again / "model-00009-of-00009.safetensors").exists()


@pytest.mark.slow
def test_cli_runs_as_module(runs):
  # `ls`: the module's entry point in a process that needs no TensorFlow
  # (`verify` and the other commands are tested in this process, above).
  p = subprocess.run([sys.executable, "-m", "tfdp.cli.ckpt", "ls", os.path.join(runs["root"], "a")],
                     env=_env(), cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert (p.returncode, p.stderr) == (0, ""), p.stderr[-2000:]
  assert p.stdout.splitlines()[1].startswith("ckpt-1 ") and "sizes ok" in p.stdout, p.stdout
