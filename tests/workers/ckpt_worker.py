"""Worker of the checkpoint tests: saves/restores a small state under MWMS or alone."""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tfdp import errors  # pylint: disable=g-import-not-at-top
from tfdp.checkpoint import CheckpointManager  # pylint: disable=g-import-not-at-top
from tests import save_faults  # pylint: disable=g-import-not-at-top

# "phase:worker[,phase:worker...]" makes that worker SIGKILL itself when its
# save reaches that phase (save_faults.PHASES), once install_crash_hook() ran.
CRASH_ENV = "TFDP_CKPT_TEST_CRASH_AT"

# name -> (shape, dtype); about 3 MB in all.
SPECS = {
    "w0": ((512, 512), "float32"),
    "w1": ((256, 1024), "float32"),
    "w2": ((700, 300), "float32"),
    "w3": ((1000,), "float64"),
    "emb": ((300, 300), "float16"),  # MWMS cannot broadcast bfloat16.
    "ids": ((50,), "int64"),
    "step": ((), "int64"),
}


def _crash_hook(phase, worker):
  spec = os.environ.get(CRASH_ENV, "")
  for item in filter(None, spec.split(",")):
    want, _, who = item.partition(":")
    if want == phase and (who == "" or int(who) == worker):
      print(f"tfdp test: {CRASH_ENV}={spec}: killing worker {worker} at {phase}.",
            flush=True)
      os.kill(os.getpid(), signal.SIGKILL)


def install_crash_hook():
  """Makes saves in this process honour CRASH_ENV (read at each phase)."""
  save_faults.install(_crash_hook)


def values(seed):
  rng = np.random.default_rng(seed)
  out = {}
  for name, (shape, dtype) in SPECS.items():
    if dtype.startswith("int"):
      out[name] = rng.integers(0, 1000, size=shape).astype(dtype)
    else:
      out[name] = rng.standard_normal(shape).astype(np.float32).astype(
          tf.as_dtype(dtype).as_numpy_dtype)
  return out


def state_bytes():
  return sum(v.nbytes for v in values(0).values())


def make_state(init):
  """A tf.Module of variables (init: dict of arrays or None for zeros)."""
  m = tf.Module()
  for name, (shape, dtype) in SPECS.items():
    v = init[name] if init else np.zeros(shape, tf.as_dtype(dtype).as_numpy_dtype)
    setattr(m, name, tf.Variable(v, dtype=tf.as_dtype(dtype), name=name))
  return m


def read(m):
  return {name: getattr(m, name).numpy() for name in SPECS}


def assign(m, vals):
  for name in SPECS:
    getattr(m, name).assign(vals[name])


def same(a, b):
  return all(np.array_equal(np.asarray(a[k]).astype(np.float64),
                            np.asarray(b[k]).astype(np.float64)) for k in SPECS)


def mwms():
  comm = tf.distribute.experimental.CommunicationOptions(
      implementation=tf.distribute.experimental.CommunicationImplementation.RING)
  return tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)


def main_mwms(a):
  """Restore (N->M check) then sync save and async save under MWMS."""
  strategy = mwms()
  with strategy.scope():
    model = make_state(None)
  pos = tf.Variable(-1, dtype=tf.int64)  # Per-worker state, not mirrored.
  ckpt = tf.train.Checkpoint(model=model)
  mgr = CheckpointManager(ckpt, a.dir, per_worker={"pos": pos},
                          global_batch_size=32, commit_timeout=60,
                          max_shard_bytes=a.max_shard_bytes, strategy=strategy)
  w, n = mgr.worker_index, mgr.num_workers
  res = {"worker": w, "num_workers": n}
  if a.restore_from:
    src = CheckpointManager(tf.train.Checkpoint(model=model), a.restore_from,
                            per_worker={"pos": pos}, strategy=strategy)
    with strategy.scope():
      path = src.restore_or_initialize()
    res["restored"] = path
    res["restored_ok"] = same(read(model), np.load(a.expect))
    res["restored_pos"] = int(pos.numpy())
  assign(model, values(a.seed))
  pos.assign(100 + w)
  res["sync_path"] = mgr.save()
  res["latest_after_sync"] = mgr.latest_checkpoint
  if w == 0:
    np.savez(os.path.join(a.out, "sync_values.npz"), **read(model))
  # Async: returns after the host copy; later updates must not leak in.
  mgr2 = CheckpointManager(tf.train.Checkpoint(model=model), a.dir + "_async",
                           async_save=True, commit_timeout=60, strategy=strategy)
  expected = read(model)
  t0 = time.time()
  res["async_path"] = mgr2.save()
  res["async_returned"] = time.time()
  res["async_blocked_s"] = res["async_returned"] - t0
  res["async_running_after_return"] = mgr2._writer.running()  # pylint: disable=protected-access
  assign(model, values(a.seed + 1000))
  mgr2.wait_until_finished()
  res["async_latest"] = mgr2.latest_checkpoint
  if w == 0:
    np.savez(os.path.join(a.out, "async_values.npz"), **expected)
  with open(os.path.join(a.out, f"result-w{w}.json"), "w") as f:
    json.dump(res, f)


def main_outside(a):
  """As TF tutorials build it: the manager outside strategy.scope(), no strategy=."""
  strategy = mwms()
  with strategy.scope():
    model = make_state(values(a.seed))
  mgr = CheckpointManager(tf.train.Checkpoint(model=model), a.dir, max_to_keep=2,
                          commit_timeout=60)
  paths = []
  for i in range(3):
    assign(model, values(a.seed + i))
    paths.append(mgr.save())
  res = {"worker": mgr.worker_index, "num_workers": mgr.num_workers, "paths": paths,
         "checkpoints": mgr.checkpoints}
  with open(os.path.join(a.out, f"outside-w{mgr.worker_index}.json"), "w") as f:
    json.dump(res, f)


def main_crash(a):
  """Explicit worker args (no collectives): a good save, then a crashing one."""
  w = int(os.environ["TFDP_WORKER_INDEX"])
  n = int(os.environ["TFDP_NUM_WORKERS"])
  model = make_state(values(a.seed))
  mgr = CheckpointManager(tf.train.Checkpoint(model=model), a.dir,
                          worker_index=w, num_workers=n, run_id=a.run_id,
                          commit_timeout=a.timeout)
  mgr.save()
  assign(model, values(a.seed + 1))
  os.environ[CRASH_ENV] = a.crash_at
  try:
    mgr.save()
  except errors.CheckpointError as e:
    print(f"save failed as expected: {e}", flush=True)
    sys.exit(3)
  sys.exit(0)


def main_mirrored(a):
  """Restores into MirroredStrategy with 3 replicas (logical CPUs)."""
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(3)])
  with strategy.scope():
    model = make_state(None)
    mgr = CheckpointManager(tf.train.Checkpoint(model=model), a.restore_from)
    path = mgr.restore_or_initialize()
  ok = path is not None and same(read(model), np.load(a.expect))
  replicas_ok = all(
      np.array_equal(np.asarray(t).astype(np.float64),
                     np.asarray(model.w0.values[0]).astype(np.float64))
      for t in model.w0.values)
  print(json.dumps({"path": path, "ok": ok, "replicas": len(model.w0.values),
                    "replicas_ok": bool(replicas_ok)}))
  sys.exit(0 if ok and replicas_ok else 4)


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["mwms", "crash", "mirrored", "outside"])
  p.add_argument("--dir")
  p.add_argument("--out")
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--restore_from")
  p.add_argument("--expect")
  p.add_argument("--max_shard_bytes", type=int, default=None)
  p.add_argument("--run_id")
  p.add_argument("--crash_at", default="")
  p.add_argument("--timeout", type=float, default=20)
  args = p.parse_args()
  install_crash_hook()
  {"mwms": main_mwms, "crash": main_crash, "mirrored": main_mirrored,
   "outside": main_outside}[args.mode](args)
