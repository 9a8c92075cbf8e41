"""tfdp-launch: runs N worker processes of one command and restarts the group when one fails."""

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tfdp import errors

# How long workers get to exit after SIGTERM before they are killed, when the
# group is stopped by a signal to the launcher or a worker was preempted.
DEFAULT_GRACE_SECONDS = 30.0

# After a worker failed or hung, the survivors get at most this long after
# SIGTERM: a group that lost a member cannot commit a checkpoint (saves are
# collective), so waiting longer only delays the restart.
FAILED_GROUP_GRACE_SECONDS = 1.0

# Before its first heartbeat a worker may take this long (TF start-up, waiting
# for the cluster, restoring, tracing the first step) when --hang_timeout is on.
DEFAULT_STARTUP_TIMEOUT = 600.0

# Exit codes of tfdp-launch.
EXIT_OK = 0
# A worker failed (exited non-zero, was killed or hung) and no restart was
# left; the message names the worker and, after restarts, lists every cause.
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2

# Exit codes of workers that the launcher recognises. They equal
# tfdp.preemption.EXIT_PREEMPTED and tfdp.heartbeat.EXIT_PEER_LOST (a test
# checks); they are repeated here so that the launcher imports no TensorFlow.
EXIT_PREEMPTED = 75   # saved at a step all workers agreed on; relaunch to resume
EXIT_PEER_LOST = 69   # a worker's peer disappeared; a consequence, not a cause

# Environment of every worker.
ENV_HEARTBEAT_FILE = "TFDP_HEARTBEAT_FILE"
ENV_RESTART_COUNT = "TFDP_RESTART_COUNT"

_POLL_SECONDS = 0.2


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


def cluster_spec(num_workers, port=None, host="localhost", hosts=None):
  """The `cluster` part of TF_CONFIG for `num_workers` workers.

  Args:
    num_workers: number of worker tasks.
    port: first port; workers use `port, port+1, ...`. None picks ports that
      are free on this machine (also used for `hosts`, which are expected to
      be fresh network namespaces or otherwise idle).
    host: the address every worker listens on.
    hosts: one address per worker instead of `host`.

  Returns:
    A dict `{"worker": ["host:port", ...]}`.
  """
  if num_workers < 1:
    raise errors.ConfigError(f"--num_workers must be >= 1, got {num_workers}.")
  if hosts is not None and len(hosts) != num_workers:
    raise errors.ConfigError(
        f"{len(hosts)} host(s) given for {num_workers} worker(s); give one per worker.")
  hosts = list(hosts) if hosts is not None else [host] * num_workers
  ports = (free_ports(num_workers, "localhost") if port is None else
           [port + i for i in range(num_workers)])
  return {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}


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
  if code == EXIT_PREEMPTED:
    return f"was preempted (exit code {code})"
  if code == EXIT_PEER_LOST:
    return f"lost a peer (exit code {code})"
  return f"exited with code {code}"


# What ended a group: `kind` is exit, hang or preempted; `slot` is the worker
# slot to blame; `message` is the line logged.
Failure = collections.namedtuple("Failure", "kind slot index code message")


def first_failure(ended):
  """The (index, code) to blame among workers that ended non-zero in the same poll.

  A death by a signal comes first (an outside cause), then other non-zero
  exits, then exits that are consequences of another worker's failure or
  of a signal (EXIT_PEER_LOST, EXIT_PREEMPTED); ties go to the lower index.
  """
  def rank(index_code):
    index, code = index_code
    if code < 0:
      return (0, index)
    return (2 if code in (EXIT_PEER_LOST, EXIT_PREEMPTED) else 1, index)
  return min(ended, key=rank)


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
      worker and TFDP_WORKER_INDEX, TFDP_NUM_WORKERS, TFDP_SLOT,
      TFDP_RESTART_COUNT and TFDP_HEARTBEAT_FILE are added.
    grace_seconds: time between SIGTERM and SIGKILL when stopping workers.
    out: where prefixed worker output goes (default: sys.stdout).
    slots: the slot of each worker (default 0..num_workers-1); the slot
      names the machine or namespace, the index is the TF_CONFIG task.
    hosts: address of each slot (default localhost), indexed by slot.
    wrapper: argv prefix put before `command`, formatted with {slot},
      {index} and {host} (e.g. `ip netns exec ns{slot}`).
    attempt: the restart count, given to workers as TFDP_RESTART_COUNT.
    hang_timeout: seconds without a heartbeat after which a worker counts
      as hung; 0 turns hang detection off.
    startup_timeout: the same limit before a worker's first heartbeat.
    heartbeat_dir: where heartbeat files go (default: a temporary folder).
  """

  def __init__(self, command, num_workers, *, port=None, env=None,
               grace_seconds=DEFAULT_GRACE_SECONDS, out=None, slots=None,
               hosts=None, wrapper=None, attempt=0, hang_timeout=0.0,
               startup_timeout=None, heartbeat_dir=None):
    if not command:
      raise errors.ConfigError(
          "No command to launch: put it after `--`, e.g. "
          "`tfdp-launch --num_workers=2 -- tfdp-train --strategy=multi_worker`.")
    self.command = list(command)
    self.num_workers = num_workers
    self.slots = list(range(num_workers)) if slots is None else list(slots)
    if len(self.slots) != num_workers:
      raise errors.ConfigError(f"{len(self.slots)} slots for {num_workers} workers.")
    self.hosts = ([hosts[s] for s in self.slots] if hosts is not None else None)
    self.cluster = cluster_spec(num_workers, port, hosts=self.hosts)
    self.env = dict(os.environ if env is None else env)
    self.grace_seconds = grace_seconds
    self.out = out or sys.stdout
    self.wrapper = list(wrapper or [])
    self.attempt = attempt
    self.hang_timeout = hang_timeout or 0.0
    self.startup_timeout = (startup_timeout if startup_timeout is not None else
                            max(self.hang_timeout, DEFAULT_STARTUP_TIMEOUT))
    self._own_heartbeat_dir = heartbeat_dir is None
    self.heartbeat_dir = heartbeat_dir or tempfile.mkdtemp(prefix="tfdp-heartbeat-")
    self.procs = []
    self.heartbeat_files = []
    self._pumps = []
    self._lock = threading.Lock()
    self._stopping = False
    self.signalled = False

  def _argv(self, index):
    if not self.wrapper:
      return self.command
    host = self.hosts[index] if self.hosts else "localhost"
    return [w.format(slot=self.slots[index], index=index, host=host)
            for w in self.wrapper] + self.command

  def start(self):
    for i in range(self.num_workers):
      env = dict(self.env)
      env["TF_CONFIG"] = tf_config(self.cluster, i)
      env["TFDP_WORKER_INDEX"] = str(i)
      env["TFDP_NUM_WORKERS"] = str(self.num_workers)
      env["TFDP_SLOT"] = str(self.slots[i])
      env[ENV_RESTART_COUNT] = str(self.attempt)
      beat = os.path.join(self.heartbeat_dir,
                          f"attempt{self.attempt}-worker{i}.heartbeat")
      env[ENV_HEARTBEAT_FILE] = beat
      self.heartbeat_files.append(beat)
      env.setdefault("PYTHONUNBUFFERED", "1")
      try:
        proc = subprocess.Popen(
            self._argv(i), env=env, stdin=subprocess.DEVNULL,
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

  def stop(self, sig=signal.SIGTERM, grace_seconds=None):
    """Sends `sig` to every live worker, then SIGKILL after the grace period."""
    self._stopping = True
    self.signal_all(sig)
    grace = self.grace_seconds if grace_seconds is None else grace_seconds
    deadline = time.monotonic() + grace
    for proc in self.procs:
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    self.signal_all(signal.SIGKILL)
    for proc in self.procs:
      proc.wait()

  def _heartbeat_state(self, i):
    try:
      st = os.stat(self.heartbeat_files[i])
    except OSError:
      return None
    return (st.st_mtime_ns, st.st_size)

  def _last_step(self, i):
    try:
      with open(self.heartbeat_files[i], encoding="utf-8") as f:
        return f.read().split()[0]
    except (OSError, IndexError):
      return None

  def watch(self, poll_seconds=_POLL_SECONDS):
    """Waits until every worker ended, or one failed; returns a Failure or None.

    On the first failure (non-zero exit, death by a signal, or no heartbeat
    for `hang_timeout` seconds) the other workers are stopped. A worker that
    exits with EXIT_PREEMPTED has saved with the others; they get the full
    grace period to finish. Exits after a signal to the launcher are no
    failures when they are 0 or EXIT_PREEMPTED.
    """
    started = time.monotonic()
    progress = [started] * self.num_workers
    seen = [None] * self.num_workers
    beaten = [False] * self.num_workers
    failure = None
    while True:
      codes = [p.poll() for p in self.procs]
      now = time.monotonic()
      if failure is None and not self._stopping:
        ended = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)
                 and not (self.signalled and c == EXIT_PREEMPTED)]
        if ended:
          i, code = first_failure(ended)
          kind = "preempted" if code == EXIT_PREEMPTED else "exit"
          failure = Failure(kind, self.slots[i], i, code,
                            f"worker {i} {_describe_exit(code)}")
        elif self.hang_timeout > 0:
          for i, code in enumerate(codes):
            if code is not None:
              continue
            state = self._heartbeat_state(i)
            if state is not None and state != seen[i]:
              seen[i], progress[i], beaten[i] = state, now, True
            limit = self.hang_timeout if beaten[i] else self.startup_timeout
            if now - progress[i] > limit:
              if beaten[i]:
                what = (f"worker {i} made no progress for {limit:g} s (last "
                        f"heartbeat at step {self._last_step(i)})")
              else:
                what = (f"worker {i} wrote no heartbeat within {limit:g} s of "
                        "its start")
              failure = Failure("hang", self.slots[i], i, None, what)
              break
        if failure is not None:
          self.log(f"{failure.message}; stopping the other workers.")
          self.stop(grace_seconds=(
              self.grace_seconds if failure.kind == "preempted" else
              min(self.grace_seconds, FAILED_GROUP_GRACE_SECONDS)))
          codes = [p.poll() for p in self.procs]
      if all(c is not None for c in codes):
        break
      time.sleep(poll_seconds)
    for pump in self._pumps:
      pump.join(timeout=5)
    self.cleanup()
    return failure

  def wait(self, poll_seconds=_POLL_SECONDS):
    """Waits for the group; returns None or a failure message.

    The first worker to exit non-zero stops the others; its failure is the
    one reported.
    """
    failure = self.watch(poll_seconds)
    return failure.message if failure else None

  def codes(self):
    """The exit code of every worker (None while running)."""
    return [p.poll() for p in self.procs]

  def cleanup(self):
    """Removes the heartbeat folder if this launcher made it."""
    if self._own_heartbeat_dir:
      shutil.rmtree(self.heartbeat_dir, ignore_errors=True)

  def log(self, msg):
    with self._lock:
      self.out.write(f"[tfdp-launch] {msg}\n")
      self.out.flush()

  _log = log


class _Slots:
  """Which worker slots take part, under `--elastic`.

  A slot "keeps failing" when it was blamed for `slot_failures` attempts in
  a row (the worker that died, exited non-zero or hung first; a worker that
  only lost its peer is never blamed). Such a slot is left out of the next
  attempts while at least `min_workers` remain. Before every restart a
  left-out slot is checked again: with `slot_check`, it returns when that
  command exits 0; without, it returns after sitting out one attempt. A
  returning slot that is blamed once more is left out again at once.
  """

  def __init__(self, num_slots, min_workers, slot_failures, slot_check,
               hosts, log):
    self.active = list(range(num_slots))
    self.dropped = {}  # slot -> attempts sat out
    self.streak = [0] * num_slots
    self.min_workers = min_workers
    self.slot_failures = slot_failures
    self.slot_check = slot_check
    self.hosts = hosts
    self.log = log

  def record(self, failure):
    for s in self.active:
      if failure is None or s != failure.slot or failure.kind == "preempted":
        self.streak[s] = 0
    if failure is None or failure.kind == "preempted":
      return
    self.streak[failure.slot] += 1
    if (self.streak[failure.slot] >= self.slot_failures
        and len(self.active) > self.min_workers):
      self.active.remove(failure.slot)
      self.dropped[failure.slot] = 0
      self.log(f"slot {failure.slot} failed {self.streak[failure.slot]} attempts in a "
               f"row; leaving it out ({len(self.active)} workers).")

  def _healthy(self, slot):
    if not self.slot_check:
      return self.dropped[slot] >= 1
    host = self.hosts[slot] if self.hosts else "localhost"
    cmd = self.slot_check.format(slot=slot, host=host)
    try:
      return subprocess.run(cmd, shell=True, timeout=30, check=False,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode == 0
    except subprocess.TimeoutExpired:
      return False

  def before_attempt(self):
    for slot in sorted(self.dropped):
      if self._healthy(slot):
        del self.dropped[slot]
        self.active.append(slot)
        self.active.sort()
        self.streak[slot] = self.slot_failures - 1
        self.log(f"slot {slot} is back; using {len(self.active)} workers.")

  def after_attempt(self):
    for slot in self.dropped:
      self.dropped[slot] += 1


def launch(command, num_workers, env=None, *, port=None,
           grace_seconds=DEFAULT_GRACE_SECONDS, out=None, max_restarts=0,
           hang_timeout=0.0, startup_timeout=None, elastic=False,
           min_workers=None, slot_failures=2, slot_check=None, hosts=None,
           wrapper=None):
  """Runs `command` as `num_workers` workers, restarting the group on failures.

  SIGINT and SIGTERM received by this process are forwarded to every worker
  and end the restarts.

  Args:
    command: argv list of each worker.
    num_workers: number of workers (slots).
    env: environment for the workers (default: this process's).
    port: first port (workers take consecutive ports); None picks free ports,
      new ones at every restart.
    grace_seconds: how long stopped workers get before SIGKILL.
    out: stream for prefixed worker output (default: sys.stdout).
    max_restarts: how many times the whole group may be restarted after a
      worker exits non-zero, is killed or hangs.
    hang_timeout: seconds without a heartbeat (TFDP_HEARTBEAT_FILE) after
      which a worker counts as hung; 0 (default) turns it off.
    startup_timeout: the limit before a worker's first heartbeat (default
      max(hang_timeout, 600)).
    elastic: leave out a slot that keeps failing (see `_Slots`), down to
      `min_workers`, and take it back when it is healthy.
    min_workers: the fewest workers an elastic job runs with (default 1).
    slot_failures: blamed attempts in a row that make a slot "keep failing".
    slot_check: shell command, formatted with {slot} and {host}, that exits 0
      when a left-out slot may return.
    hosts: the address of each slot (default localhost for all).
    wrapper: argv prefix formatted with {slot}, {index}, {host}.

  Returns:
    0 when every worker of an attempt exited 0; EXIT_PREEMPTED when the
    launcher was signalled and the workers saved and exited with it; else
    EXIT_WORKER_FAILED.
  """
  if max_restarts < 0:
    raise errors.ConfigError(f"--max_restarts must be >= 0, got {max_restarts}.")
  min_workers = 1 if min_workers is None else min_workers
  if elastic and not 1 <= min_workers <= num_workers:
    raise errors.ConfigError(
        f"--min_workers must be in [1, --num_workers={num_workers}], got {min_workers}.")
  if slot_failures < 1:
    raise errors.ConfigError(f"--slot_failures must be >= 1, got {slot_failures}.")
  out = out or sys.stdout
  lock = threading.Lock()

  def log(msg):
    with lock:
      out.write(f"[tfdp-launch] {msg}\n")
      out.flush()

  slots = _Slots(num_workers, min_workers if elastic else num_workers,
                 slot_failures, slot_check, hosts, log)
  state = {"launcher": None, "signalled": None}

  def forward(signum, _frame):
    state["signalled"] = signum
    launcher = state["launcher"]
    log(f"received {signal.Signals(signum).name}; forwarding to workers; no "
        "more restarts.")
    if launcher is not None:
      launcher.signalled = True
      launcher.signal_all(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous[sig] = signal.signal(sig, forward)
  heartbeat_dir = tempfile.mkdtemp(prefix="tfdp-heartbeat-")
  causes = []
  try:
    attempt = 0
    while True:
      if elastic and attempt:
        slots.before_attempt()
      launcher = Launcher(
          command, len(slots.active), port=port, env=env,
          grace_seconds=grace_seconds, out=out, slots=slots.active,
          hosts=hosts, wrapper=wrapper, attempt=attempt,
          hang_timeout=hang_timeout, startup_timeout=startup_timeout,
          heartbeat_dir=heartbeat_dir)
      launcher._lock = lock  # pylint: disable=protected-access
      if attempt:
        log(f"attempt {attempt + 1}: starting {launcher.num_workers} worker(s) "
            f"(slots {launcher.slots}) at {', '.join(launcher.cluster['worker'])}.")
      state["launcher"] = launcher
      launcher.signalled = state["signalled"] is not None
      if state["signalled"] is not None:
        log("stopped by a signal before the restart; causes: " + "; ".join(causes) + ".")
        return EXIT_WORKER_FAILED
      launcher.start()
      failure = launcher.watch()
      if state["signalled"] is not None or launcher.signalled:
        codes = launcher.codes()
        if failure is None and all(c in (0, EXIT_PREEMPTED) for c in codes):
          if any(c == EXIT_PREEMPTED for c in codes):
            log(f"workers saved and exited after the signal; exit code "
                f"{EXIT_PREEMPTED}: run the same command again to resume.")
            return EXIT_PREEMPTED
          return EXIT_OK
        log(f"job failed after the signal: {failure.message if failure else codes}.")
        return EXIT_WORKER_FAILED
      if elastic:
        slots.after_attempt()
        slots.record(failure)
      if failure is None:
        if attempt:
          log(f"job finished after {attempt} restart(s).")
        return EXIT_OK
      causes.append(f"attempt {attempt + 1}: {failure.message}")
      if attempt >= max_restarts:
        if max_restarts:
          log(f"giving up after {attempt} restart(s) (--max_restarts="
              f"{max_restarts}); causes: " + "; ".join(causes) + ".")
        log(f"job failed: {failure.message}.")
        return EXIT_WORKER_FAILED
      attempt += 1
      log(f"restart {attempt}/{max_restarts}: {failure.message}; restarting "
          "the group from the newest intact checkpoint.")
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    shutil.rmtree(heartbeat_dir, ignore_errors=True)
  return EXIT_WORKER_FAILED


def _parse(argv):
  if "--" in argv:
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1:]
  else:
    own, command = argv, []
  parser = argparse.ArgumentParser(
      prog="tfdp-launch",
      description="Run COMMAND as N workers, each with its own TF_CONFIG; "
                  "restart the group when a worker fails.",
      usage="tfdp-launch --num_workers=N [--max_restarts=K] [...] -- COMMAND [ARGS...]",
      epilog=f"Exit codes: {EXIT_OK} every worker exited 0; {EXIT_WORKER_FAILED} "
             f"a worker failed and no restart was left; {EXIT_USAGE} usage "
             f"error; {EXIT_PREEMPTED} the launcher was signalled and the "
             "workers saved (run again to resume).")
  parser.add_argument("--num_workers", type=int, default=None,
                      help="number of worker processes (default 2, or one per --hosts)")
  parser.add_argument("--port", type=int, default=None,
                      help="first port; workers use consecutive ports "
                           "(default: free ports, new at every restart)")
  parser.add_argument("--grace_seconds", type=float,
                      default=DEFAULT_GRACE_SECONDS,
                      help="seconds between SIGTERM and SIGKILL when stopping "
                           "workers")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="restart the whole group up to K times when a "
                           "worker exits non-zero, is killed or hangs")
  parser.add_argument("--hang_timeout", type=float, default=0.0,
                      help="a worker with no heartbeat for this many seconds "
                           "counts as failed (0: off)")
  parser.add_argument("--startup_timeout", type=float, default=None,
                      help="the hang limit before a worker's first heartbeat "
                           f"(default max(hang_timeout, {DEFAULT_STARTUP_TIMEOUT:g}))")
  parser.add_argument("--elastic", action="store_true",
                      help="leave out a worker slot that keeps failing (down "
                           "to --min_workers) with the same global batch")
  parser.add_argument("--min_workers", type=int, default=1,
                      help="the fewest workers of an --elastic job")
  parser.add_argument("--slot_failures", type=int, default=2,
                      help="attempts in a row a slot must be blamed for to be "
                           "left out (--elastic)")
  parser.add_argument("--slot_check", default=None,
                      help="shell command ({slot}, {host}) that exits 0 when a "
                           "left-out slot may return (--elastic; default: "
                           "retry it after one attempt)")
  parser.add_argument("--hosts", default=None,
                      help="comma-separated address of each worker slot "
                           "(default localhost)")
  parser.add_argument("--wrapper", default=None,
                      help="command prefix of each worker, formatted with "
                           "{slot}, {index}, {host}; e.g. 'ip netns exec ns{slot}'")
  args = parser.parse_args(own)
  if not command:
    parser.error("no COMMAND given after `--`")
  args.hosts = args.hosts.split(",") if args.hosts else None
  if args.num_workers is None:
    args.num_workers = len(args.hosts) if args.hosts else 2
  if args.num_workers < 1:
    parser.error(f"--num_workers must be >= 1, got {args.num_workers}")
  if args.hosts and len(args.hosts) != args.num_workers:
    parser.error(f"--hosts names {len(args.hosts)} hosts for --num_workers="
                 f"{args.num_workers}")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
  if args.hang_timeout < 0:
    parser.error(f"--hang_timeout must be >= 0, got {args.hang_timeout}")
  if args.elastic and not 1 <= args.min_workers <= args.num_workers:
    parser.error(f"--min_workers must be in [1, {args.num_workers}], got "
                 f"{args.min_workers}")
  if args.slot_failures < 1:
    parser.error(f"--slot_failures must be >= 1, got {args.slot_failures}")
  args.wrapper = shlex.split(args.wrapper) if args.wrapper else None
  return args, command


def run(argv=None):
  """Console entry point of `tfdp-launch`."""
  args, command = _parse(sys.argv[1:] if argv is None else argv)
  try:
    code = launch(command, args.num_workers, port=args.port,
                  grace_seconds=args.grace_seconds,
                  max_restarts=args.max_restarts,
                  hang_timeout=args.hang_timeout,
                  startup_timeout=args.startup_timeout, elastic=args.elastic,
                  min_workers=args.min_workers,
                  slot_failures=args.slot_failures, slot_check=args.slot_check,
                  hosts=args.hosts, wrapper=args.wrapper)
  except errors.TfdpError as e:
    print(f"tfdp-launch: error: {e}", file=sys.stderr)
    code = EXIT_USAGE
  sys.exit(code)


if __name__ == "__main__":
  run()
