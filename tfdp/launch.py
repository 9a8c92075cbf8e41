"""Local launcher: runs N worker processes of one command, each with its own TF_CONFIG."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfdp import errors

# How long workers get to exit after SIGTERM before they are killed.
DEFAULT_GRACE_SECONDS = 30.0

# Exit code of the launcher when a worker fails (the worker's own code is
# reported in the message; a signal death has no portable exit code).
EXIT_WORKER_FAILED = 1


def free_ports(n, host="localhost"):
  """Returns `n` distinct TCP ports that are free on `host` right now.

  All sockets are held open until every port is chosen, so the ports are
  distinct; another process may still take one before the worker binds it,
  which is the usual race of every local launcher and is rare in practice.
  """
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def cluster_spec(num_workers, port=None, host="localhost"):
  """The `cluster` part of TF_CONFIG for `num_workers` local workers.

  Args:
    num_workers: number of worker tasks.
    port: first port; workers use `port, port+1, ...`. None picks free ports.
    host: the address the workers listen on.

  Returns:
    A dict `{"worker": ["host:port", ...]}`.
  """
  if num_workers < 1:
    raise errors.ConfigError(f"--num_workers must be >= 1, got {num_workers}.")
  ports = (free_ports(num_workers, host) if port is None else
           [port + i for i in range(num_workers)])
  return {"worker": [f"{host}:{p}" for p in ports]}


def tf_config(cluster, index):
  """The TF_CONFIG string of worker `index` in `cluster`."""
  return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _describe_exit(code):
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"was killed by {name}"
  return f"exited with code {code}"


class _Pump(threading.Thread):
  """Copies a worker's output to ours, one prefixed line at a time."""

  def __init__(self, stream, prefix, out, lock):
    super().__init__(daemon=True)
    self._stream, self._prefix, self._out, self._lock = stream, prefix, out, lock

  def run(self):
    for raw in iter(self._stream.readline, b""):
      line = raw.decode("utf-8", errors="replace").rstrip("\n")
      with self._lock:
        self._out.write(f"{self._prefix}{line}\n")
        self._out.flush()
    self._stream.close()


class Launcher:
  """Starts, watches and stops one group of local worker processes.

  Args:
    command: the argv of every worker.
    num_workers: how many workers.
    port: first port of the cluster, or None for free ports.
    env: environment of the workers (default: ours); TF_CONFIG is set per
      worker and TFDP_WORKER_INDEX / TFDP_NUM_WORKERS are added.
    grace_seconds: time between SIGTERM and SIGKILL when stopping workers.
    out: where prefixed worker output goes (default: sys.stdout).
  """

  def __init__(self, command, num_workers, *, port=None, env=None,
               grace_seconds=DEFAULT_GRACE_SECONDS, out=None):
    if not command:
      raise errors.ConfigError(
          "No command to launch: put it after `--`, e.g. "
          "`tfdp-launch --num_workers=2 -- tfdp-train --strategy=multi_worker`.")
    self.command = list(command)
    self.num_workers = num_workers
    self.cluster = cluster_spec(num_workers, port)
    self.env = dict(os.environ if env is None else env)
    self.grace_seconds = grace_seconds
    self.out = out or sys.stdout
    self.procs = []
    self._pumps = []
    self._lock = threading.Lock()
    self._stopping = False

  def start(self):
    for i in range(self.num_workers):
      env = dict(self.env)
      env["TF_CONFIG"] = tf_config(self.cluster, i)
      env["TFDP_WORKER_INDEX"] = str(i)
      env["TFDP_NUM_WORKERS"] = str(self.num_workers)
      env.setdefault("PYTHONUNBUFFERED", "1")
      try:
        proc = subprocess.Popen(
            self.command, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
      except OSError as e:
        self.stop()
        raise errors.ConfigError(
            f"Cannot start worker {i} with command {self.command!r}: {e}") from e
      self.procs.append(proc)
      pump = _Pump(proc.stdout, f"[worker {i}] ", self.out, self._lock)
      pump.start()
      self._pumps.append(pump)

  def signal_all(self, sig):
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass

  def stop(self, sig=signal.SIGTERM):
    """Sends `sig` to every live worker, then SIGKILL after the grace period."""
    self._stopping = True
    self.signal_all(sig)
    deadline = time.monotonic() + self.grace_seconds
    for proc in self.procs:
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    self.signal_all(signal.SIGKILL)
    for proc in self.procs:
      proc.wait()

  def wait(self, poll_seconds=0.2):
    """Waits for the group; returns 0 or a failure message.

    The first worker to exit non-zero stops the others; its failure is the
    one reported.
    """
    failure = None
    while True:
      codes = [p.poll() for p in self.procs]
      if failure is None:
        for i, code in enumerate(codes):
          if code not in (None, 0):
            failure = f"worker {i} {_describe_exit(code)}"
            if not self._stopping:
              self._log(f"{failure}; stopping the other workers.")
              self.stop()
            break
      if all(c is not None for c in codes):
        break
      time.sleep(poll_seconds)
    for pump in self._pumps:
      pump.join(timeout=5)
    return failure

  def _log(self, msg):
    with self._lock:
      self.out.write(f"[tfdp-launch] {msg}\n")
      self.out.flush()


def launch(command, num_workers, env=None, *, port=None,
           grace_seconds=DEFAULT_GRACE_SECONDS, out=None):
  """Runs `command` as `num_workers` local workers and waits for them.

  SIGINT and SIGTERM received by this process are forwarded to every worker.

  Args:
    command: argv list of each worker.
    num_workers: number of workers.
    env: environment for the workers (default: this process's).
    port: first port (workers take consecutive ports); None picks free ports.
    grace_seconds: how long stopped workers get before SIGKILL.
    out: stream for prefixed worker output (default: sys.stdout).

  Returns:
    0 when every worker exited 0, else EXIT_WORKER_FAILED.
  """
  launcher = Launcher(command, num_workers, port=port, env=env,
                      grace_seconds=grace_seconds, out=out)
  forwarded = []

  def forward(signum, _frame):
    forwarded.append(signum)
    launcher._log(f"received {signal.Signals(signum).name}; forwarding to workers.")
    launcher.signal_all(signum)

  previous = {}
  in_main_thread = threading.current_thread() is threading.main_thread()
  if in_main_thread:
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous[sig] = signal.signal(sig, forward)
  try:
    launcher.start()
    failure = launcher.wait()
  finally:
    if in_main_thread:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
  if failure:
    launcher._log(f"job failed: {failure}.")
    return EXIT_WORKER_FAILED
  return 0


def _parse(argv):
  if "--" in argv:
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1:]
  else:
    own, command = argv, []
  parser = argparse.ArgumentParser(
      prog="tfdp-launch",
      description="Run COMMAND as N local workers, each with its own TF_CONFIG.",
      usage="tfdp-launch --num_workers=N [--port=P] -- COMMAND [ARGS...]")
  parser.add_argument("--num_workers", type=int, default=2,
                      help="number of worker processes (default 2)")
  parser.add_argument("--port", type=int, default=None,
                      help="first port; workers use consecutive ports "
                           "(default: free ports)")
  parser.add_argument("--grace_seconds", type=float,
                      default=DEFAULT_GRACE_SECONDS,
                      help="seconds between SIGTERM and SIGKILL when stopping "
                           "workers")
  args = parser.parse_args(own)
  if not command:
    parser.error("no COMMAND given after `--`")
  if args.num_workers < 1:
    parser.error(f"--num_workers must be >= 1, got {args.num_workers}")
  return args, command


def run(argv=None):
  """Console entry point of `tfdp-launch`."""
  args, command = _parse(sys.argv[1:] if argv is None else argv)
  try:
    code = launch(command, args.num_workers, port=args.port,
                  grace_seconds=args.grace_seconds)
  except errors.TfdpError as e:
    print(f"tfdp-launch: error: {e}", file=sys.stderr)
    code = 2
  sys.exit(code)


if __name__ == "__main__":
  run()
