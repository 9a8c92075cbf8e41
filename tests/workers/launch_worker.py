"""A worker for tests/test_launch_failures.py, without TensorFlow: `launch_worker.py MODE DIR`.

Modes: `same` (every worker raises the same ConfigError, which names the
worker, its pid and a temp folder), `different` (each raises its own),
`signal` (worker 0 is killed by SIGKILL), `peer` (worker 0 is killed, worker 1
then fails with TF's error for a lost peer, as a collective does), `noise` (TF-like start-up lines,
then `same`), `bar` (a progress bar redrawn with `\\r` for 2.5 s, then its
line ends with the time it ended). DIR is a folder shared by the workers.
"""

import atexit
import os
import signal
import sys
import tempfile
import time

from tfdp import errors

INDEX = int(os.environ["TFDP_WORKER_INDEX"])
NUM_WORKERS = int(os.environ["TFDP_NUM_WORKERS"])

# What TF 2.21 prints at start-up on a machine without a GPU (see tfdp.launch.noise.NOISE).
NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796133538.349871   {pid} cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "I0000 00:00:1796133539.073626   {pid} cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
    "E0000 00:00:1796133548.104951   {pid} cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
]


def barrier(directory):
  """Waits until every worker is here, then lives 1 s past its error: all print it before one exits."""
  open(os.path.join(directory, f"ready-{INDEX}"), "w", encoding="utf-8").close()
  deadline = time.monotonic() + 60
  while (sum(f.startswith("ready-") for f in os.listdir(directory)) < NUM_WORKERS
         and time.monotonic() < deadline):
    time.sleep(0.02)
  atexit.register(time.sleep, 1)


def check_batch(directory):
  barrier(directory)
  scratch = tempfile.mkdtemp(dir=directory)
  raise errors.ConfigError(
      f"--batch_size=33 is not a multiple of the {NUM_WORKERS} workers (this is worker "
      f"{INDEX}, pid {os.getpid()}, scratch {os.path.basename(scratch)}).")


def bar(seconds=2.5, steps=25):
  for step in range(1, steps + 1):
    sys.stdout.write("\b" * 40 + f"\r{step}/{steps} [{'=' * step}{'.' * (steps - step)}]")
    sys.stdout.flush()
    time.sleep(seconds / steps)
  sys.stdout.write(f"\r{steps}/{steps} done at {time.time():.3f}\n")
  sys.stdout.flush()


def main(mode, directory):
  if mode == "noise":
    for line in NOISE:
      print(line.format(pid=os.getpid()), file=sys.stderr, flush=True)
    mode = "same"
  if mode == "same":
    check_batch(directory)
  elif mode == "different":
    barrier(directory)
    if INDEX == 0:
      raise ValueError("learning rate must be positive, got -0.1")
    raise KeyError("label")
  elif mode == "signal":
    if INDEX == 0:
      print("about to be killed", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
  elif mode == "peer":
    if INDEX == 0:
      barrier(directory)
      os.kill(os.getpid(), signal.SIGKILL)

    def collective_aborted(signum, frame):
      del signum, frame
      print("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
            "tensorflow.python.framework.errors_impl.UnavailableError: Graph execution error:",
            file=sys.stderr, flush=True)
      os._exit(1)  # pylint: disable=protected-access

    signal.signal(signal.SIGTERM, collective_aborted)
    barrier(directory)
    time.sleep(120)
  elif mode == "bar":
    bar()
    print(f"worker {INDEX} finished", flush=True)
  else:
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(*sys.argv[1:])
