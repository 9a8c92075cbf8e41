"""One writer per checkpoint directory: the lease, its refusal, and when a stale one is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests import shared
from tests.conftest import launch_workers
from tests.shared import shared_run
from tfdp import errors
from tfdp.checkpoint import CheckpointManager
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.persistent import lease as lease_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLDER = """
import sys, time
import tensorflow as tf
from tfdp.checkpoint import CheckpointManager
mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(3.0)), sys.argv[1])
mgr.save()
print("ready", flush=True)
time.sleep(120)
"""


def _lease(directory):
  with open(os.path.join(directory, layout_lib.LEASE_FILENAME)) as f:
    return json.load(f)


def _write_lease(directory, **fields):
  lease = dict({"session": "other", "host": socket.gethostname(), "pid": os.getpid(),
                "heartbeat": time.time()}, **fields)
  with open(os.path.join(directory, layout_lib.LEASE_FILENAME), "w") as f:
    json.dump(lease, f)


@pytest.fixture(scope="module")
def held(tmp_path_factory):
  """A directory leased by another live process (a real second job)."""
  d = str(tmp_path_factory.mktemp("lease") / "model")
  env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, d], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  assert proc.stdout.readline().strip() == "ready"
  yield d, proc
  proc.kill()
  proc.wait()


@pytest.mark.slow
def test_a_second_job_is_refused_before_it_deletes_anything(held):
  d, proc = held
  # Leftovers a cleanup would delete: a torn save's temp dir and a torn manifest.
  torn = os.path.join(d, layout_lib.TMP_DIRNAME, "zzz-000001-ckpt-9")
  os.makedirs(torn, exist_ok=True)
  open(os.path.join(d, "ckpt-9.manifest.json.tmp-1"), "w").close()
  before = sorted(os.listdir(d))
  with pytest.raises(errors.CheckpointError) as e:
    CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), d)
  msg = str(e.value)
  assert f"host {socket.gethostname()}" in msg and f"pid {proc.pid}" in msg, msg
  assert sorted(os.listdir(d)) == before and os.path.isdir(torn)
  # A worker of another session (explicit indices, run id B) is refused too.
  with pytest.raises(errors.CheckpointError, match=f"pid {proc.pid}"):
    CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), d, worker_index=1,
                      num_workers=2, run_id="B", commit_timeout=0.3)
  assert _lease(d)["pid"] == proc.pid


@pytest.mark.slow
def test_a_dead_holder_on_this_host_is_taken_over(held):
  d, proc = held
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  v = tf.Variable(0.0)
  mgr = CheckpointManager(tf.train.Checkpoint(v=v), d)
  assert _lease(d)["pid"] == os.getpid()
  assert mgr.restore_or_initialize() == os.path.join(d, "ckpt-1") and v.numpy() == 3.0
  # Its cleanup ran once the lease was ours.
  assert not os.path.exists(os.path.join(d, "ckpt-9.manifest.json.tmp-1"))


def test_same_process_replaces_and_close_releases(tmp_path):
  d = str(tmp_path)
  first = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), d)
  first.save()
  second = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(2.0)), d)  # fit, fit again
  assert _lease(d)["pid"] == os.getpid()
  second.restore_or_initialize()
  assert os.path.basename(second.save()) == "ckpt-2"
  second.close()
  assert not os.path.exists(os.path.join(d, layout_lib.LEASE_FILENAME))
  assert os.path.basename(second.save()) == "ckpt-3"  # Taken again.
  assert os.path.exists(os.path.join(d, layout_lib.LEASE_FILENAME))


def test_another_hosts_lease_until_its_heartbeat_expires(tmp_path):
  d = str(tmp_path)
  _write_lease(d, host="elsewhere", pid=1, heartbeat=time.time())
  with pytest.raises(errors.CheckpointError, match="host elsewhere, pid 1"):
    CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), d)
  _write_lease(d, host="elsewhere", pid=1, heartbeat=time.time() - lease_lib.EXPIRY_S - 5)
  mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), d)
  mgr.save()
  assert _lease(d)["host"] == socket.gethostname()
  del mgr  # A manager that is gone holds nothing.
  assert not os.path.exists(os.path.join(d, layout_lib.LEASE_FILENAME))


def test_heartbeat_is_renewed_while_the_manager_lives(tmp_path, monkeypatch):
  monkeypatch.setattr(lease_lib, "RENEW_S", 0.05)
  mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), str(tmp_path))
  first = _lease(str(tmp_path))["heartbeat"]
  deadline = time.time() + 10
  while _lease(str(tmp_path))["heartbeat"] == first and time.time() < deadline:
    time.sleep(0.05)
  assert _lease(str(tmp_path))["heartbeat"] > first
  mgr.close()


REFUSED_JOB = """
import sys
import tensorflow as tf
import tfdp
from tfdp import errors
strategy = tfdp.make_strategy()
with strategy.scope():
  v = tf.Variable(1.0)
try:
  tfdp.CheckpointManager(tf.train.Checkpoint(v=v), sys.argv[1])
except errors.CheckpointError as e:
  print("refused:", e, flush=True)
  sys.exit(3)
print("not refused", flush=True)
"""


@shared_run("refused_job_runs")
def refused_job_runs(root):
  """A 2-worker job on a directory that a live holder process leases.

  Its own holder: other tests take the module's `held` directory over.
  Returns {"dir", "holder_pid", "ready" (the holder's first line), "code", "out"}.
  """
  d = str(root / "model")
  env = shared.environ(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, d], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  code, out = None, "the holder did not get ready"
  try:
    ready = proc.stdout.readline().strip()
    if ready == "ready":
      code, out = launch_workers([sys.executable, "-c", REFUSED_JOB, d], num_workers=2,
                                 timeout=240)
  finally:
    proc.kill()
    proc.wait()
  return {"dir": d, "holder_pid": proc.pid, "ready": ready, "code": code, "out": out}


@pytest.mark.slow
def test_every_worker_of_a_refused_job_gets_the_error_none_hangs(refused_job_runs):
  d, code, out = (refused_job_runs[k] for k in ("dir", "code", "out"))
  assert refused_job_runs["ready"] == "ready"
  assert code != 0, out
  assert f"[worker 0] refused: {d} is in use by another job" in out, out[-3000:]
  # Worker 1 learns it from the chief through the session agreement instead of
  # waiting in it for a chief that has given up.
  assert "[worker 1] refused: The chief could not start checkpointing" in out, out[-3000:]
  assert "not refused" not in out
  assert _lease(d)["pid"] == refused_job_runs["holder_pid"]


def test_a_writer_that_lost_its_lease_does_not_commit(tmp_path, caplog):
  """Fencing: the chief re-reads the lease just before its commit point (finding 4)."""
  from tests import save_faults  # pylint: disable=g-import-not-at-top
  d = str(tmp_path)
  mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), d)
  mgr.save()
  # A newer job takes the directory over while this chief's save is under
  # way (its heartbeat had gone stale: it stalled past the lease's lifetime).
  undo = save_faults.install(lambda phase, worker: phase == "during_commit" and _write_lease(
      d, session="newer", host="elsewhere", pid=4242))
  try:
    with pytest.raises(errors.CheckpointError) as e:
      mgr.save()
  finally:
    undo()
  assert "is now held by job session newer (host elsewhere, pid 4242" in str(e.value)
  assert not os.path.exists(os.path.join(d, "ckpt-2.manifest.json"))
  with pytest.raises(errors.CheckpointError, match="session newer"):
    mgr.save()  # Again: never a commit in a directory another job holds.
  assert _lease(d)["session"] == "newer"


def test_the_renewer_says_when_another_job_took_the_lease(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(lease_lib, "RENEW_S", 0.05)
  d = str(tmp_path)
  mgr = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0.0)), d)
  _write_lease(d, session="newer", host="elsewhere", pid=4242)
  deadline = time.time() + 10
  with caplog.at_level("ERROR"):
    while "is now held by job session newer" not in caplog.text and time.time() < deadline:
      time.sleep(0.05)
  assert "is now held by job session newer" in caplog.text
  assert _lease(d)["session"] == "newer"  # Not renewed over the other job's.
  del mgr
