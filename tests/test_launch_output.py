"""Tests of what tfdp-launch prints: known TF/gRPC noise held back unless a worker fails, each error once."""

import io
import sys

import pytest

from tfdp import launch
from tfdp.launch import noise
from tfdp.launch import output
from tfdp.launch import worker_lines
from tests.test_launch import _run_cli

PY = sys.executable

# Real lines of 2-worker runs on CPU (TF 2.21), pid field set per worker by the
# worker script; the checkpoint ones are built from TF's checkpoint.py.
NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796133538.349871   {pid} cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1796133548.104951   {pid} cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1796133539.073626   {pid} cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
    "I0000 00:00:1796133548.383058   {pid} coordination_service.cc:505] Example stragglers:",
    "/job:worker/replica:0/task:1",
    "W0000 00:00:1796133550.592144   {pid} dataset.cc:997] Input of GeneratorDatasetOp::Dataset "
    "will not be optimized because the dataset does not implement the AsGraphDefInternal() "
    "method needed to apply optimizations.",
    "E0000 00:00:1796133636.540798   {pid} base_collective_executor.cc:252] BaseCollective"
    "Executor::StartAbort UNAVAILABLE: Failed to send RPC to coordination service. Either the "
    "leader task was preempted/died/restarted unexpectedly or this task is experiencing "
    "network issues. Check earlier logs from 1) this task, 2) the leader (usually slice 0 task "
    "0), and 3) cluster scheduler to debug further.",
    "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while "
    "calling /tensorflow.CoordinationService/Heartbeat:",
    ':UNKNOWN:Error received from peer  {{grpc_status:14, grpc_message:"failed to connect to '
    'all addresses; last error: UNKNOWN: ipv4:127.0.0.1:36509: Failed to connect to remote '
    'host: Connection refused"}}',
    "E0000 00:00:1796134874.756134   {pid} base_collective_executor.cc:252] BaseCollective"
    "Executor::StartAbort UNAVAILABLE: Error reported from /job:worker/task:1: The following "
    "tasks are unhealthy (stopped sending heartbeats):",
    "/job:worker/replica:0/task:1",
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
    "(e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.Coordination"
    "ServiceError='\\\"\\n\\n\\x06worker\\x10\\x01']",
    "W1201 14:02:15.351870 {pid} checkpoint.py:225] Detecting that an object or model or "
    "tf.train.Checkpoint is being deleted with unrestored values. See the following logs for "
    "the specific values in question.",
    "WARNING:tensorflow:Value in checkpoint could not be found in the restored object: "
    "(root).optimizer._variables.1",
]

# Near misses: real errors and warnings, and tfdp's own log; always printed as they come.
KEPT = [
    "E0000 00:00:1796133548.104951   {pid} cuda_platform.cc:52] failed call to cuInit: "
    "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected",
    "E0000 00:00:1796133636.540798   {pid} base_collective_executor.cc:252] BaseCollective"
    "Executor::StartAbort INTERNAL: a real collective failure",
    "W1201 14:02:15.351870 {pid} checkpoint.py:240] An attribute in the restored object could "
    "not be found in the checkpoint. Object: (root).dense, attribute: ['kernel']",
    "W0000 00:00:1796133550.592144   {pid} allocator.cc:1] Allocation exceeds 10% of free memory.",
    "/job:worker/replica:0/task:1",  # a continuation line, but after no held record
    "I1201 14:02:15.351870 {pid} strategy.py:355] tfdp strategy: 2 replica(s) in sync",
]


def _worker(lines, exit_codes):
  """A worker that prints `lines` (with its index as the pid) and exits with exit_codes[index]."""
  return [PY, "-c",
          "import os, sys\n"
          "i = int(os.environ['TFDP_WORKER_INDEX'])\n"
          f"for line in {lines!r}:\n"
          "  print(line.format(pid=1000 + i), file=sys.stderr if 'E0000' in line else sys.stdout)\n"
          "sys.stdout.flush()\n"
          f"sys.exit({exit_codes!r}[i])\n"]


def _launch(lines, exit_codes, **kw):
  out = io.StringIO()
  code = launch.launch(_worker(lines, exit_codes), 2, out=out, grace_seconds=5, **kw)
  return code, out.getvalue()


def _worker_lines(text, index):
  prefix = f"[worker {index}] "
  return [l[len(prefix):] for l in text.splitlines() if l.startswith(prefix)]


@pytest.fixture(autouse=True)
def _no_show_env(monkeypatch):
  monkeypatch.delenv(noise.ENV_SHOW_TF_LOGS, raising=False)


def test_known_noise_is_hidden_when_the_job_succeeds():
  code, out = _launch(NOISE + KEPT, [0, 0])
  assert code == launch.EXIT_OK, out
  for i in range(2):
    assert _worker_lines(out, i) == [k.format(pid=1000 + i) for k in KEPT], out
  assert "held back" not in out


def test_known_noise_of_a_failed_job_is_one_count_line():
  code, out = _launch(NOISE + ["step 1 done by {pid}"], [0, 3])
  assert code == launch.EXIT_WORKER_FAILED, out
  for i in range(2):  # the job failed: worker 0's noise counts too, although it exited 0
    assert _worker_lines(out, i) == [f"step 1 done by {1000 + i}"], out
  count = (f"[tfdp-launch] {2 * len(NOISE)} TensorFlow log lines held back; --verbose_workers "
           f"or {noise.ENV_SHOW_TF_LOGS}=1 shows them")
  assert out.splitlines().count(count) == 1, out
  assert out.index("worker 1 exited with code 3") < out.index("held back"), out
  assert out.splitlines()[-1] == "[tfdp-launch] worker 1 failed: exited with code 3", out


@pytest.mark.parametrize("how", ["env", "flag"])
def test_everything_is_shown_as_it_comes_on_request(how, monkeypatch, capsys):
  if how == "env":
    monkeypatch.setenv(noise.ENV_SHOW_TF_LOGS, "1")
    code, out = _launch(NOISE, [0, 0])
  else:
    code, out = _run_cli(["--num_workers=2", "--verbose_workers", "--"] + _worker(NOISE, [0, 0]),
                         capsys)
  assert code == launch.EXIT_OK, out
  for i in range(2):
    assert _worker_lines(out, i) == [n.format(pid=1000 + i) for n in NOISE], out
  assert "held back" not in out


# Each worker lives on for 1 s after its error, so that both print it before
# the first exit stops the other.
_BAD_FLAG = ["-c", "import argparse, atexit, time; atexit.register(time.sleep, 1); "
                   "argparse.ArgumentParser(prog='train').parse_args()", "--no_such_flag=1"]
_RAISES = ["-c", "import atexit, time; atexit.register(time.sleep, 1); "
                 "raise ValueError('boom: bad config')"]


@pytest.mark.parametrize("worker", [_BAD_FLAG, _RAISES], ids=["bad_flag", "raises"])
def test_an_error_that_every_worker_hits_is_printed_once(worker, capsys):
  code, out = _run_cli(["--num_workers=2", "--", PY] + worker, capsys)
  assert code == launch.EXIT_WORKER_FAILED, out
  error = ("train: error: unrecognized arguments: --no_such_flag=1" if worker is _BAD_FLAG
           else "ValueError: boom: bad config")
  lines = out.splitlines()
  assert sum(l.endswith(error) for l in lines if not l.startswith("[tfdp-launch]")) == 1, out
  assert f"[workers 0,1] {error}" in lines, out  # printed once, naming both workers
  assert out.count("exited with code") == 1, out
  message = error.split("train: error: ")[-1]
  assert lines[-2:] == ["[tfdp-launch] job failed; exit code 1.",
                        f"[tfdp-launch] workers 0,1 failed: {message}"], out


def test_identical_lines_of_workers_that_succeed_are_all_printed():
  code, out = _launch(["loading data", "done"], [0, 0])
  assert code == launch.EXIT_OK, out
  assert _worker_lines(out, 0) == _worker_lines(out, 1) == ["loading data", "done"], out


@pytest.mark.parametrize("argv, error", [
    (["--num_workers=2"], "no COMMAND given"),
    (["--num_workers=0", "--", "true"], "--num_workers must be >= 1"),
    (["--num_workers=1", "--", "/nonexistent/binary"], "Cannot start worker 0"),
])
def test_a_usage_error_of_the_launcher_is_printed_once(argv, error, capsys):
  code, out = _run_cli(argv, capsys)
  assert code == launch.EXIT_USAGE, out
  assert out.count(error) == 1 and out.count("error:") == 1, out


def test_held_repeats_keep_their_order_and_are_released_in_time():
  stream = io.StringIO()
  lines = worker_lines.WorkerLines(output.Output(stream), 2)
  # (A traceback would be an error block, held and merged: tests/test_launch_failures.py.)
  lines.add(0, "loading the dataset")
  lines.add(1, "loading the dataset")  # a repeat: held
  lines.add(1, "its own line")         # releases it, in order
  lines.add(1, "loading the dataset")  # held again
  lines.tick(now=1e12)                 # far past REPEAT_HOLD_SECONDS
  assert stream.getvalue().splitlines() == [
      "[worker 0] loading the dataset",
      "[worker 1] loading the dataset",
      "[worker 1] its own line",
      "[worker 1] loading the dataset"]

