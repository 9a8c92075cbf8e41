"""One group of local worker processes: start them, copy their output, watch, stop; they die with the launcher."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence, TextIO, Union

from tfdp import errors
from tfdp import goodput
from tfdp.launch import signals
from tfdp.launch.addresses import cluster_spec
from tfdp.launch.addresses import tf_config
from tfdp.launch.exits import EXIT_PEER_LOST
from tfdp.launch.exits import EXIT_PREEMPTED
from tfdp.launch.exits import Failure
from tfdp.launch.exits import describe_exit
from tfdp.launch.exits import first_failure
from tfdp.launch.output import Output
from tfdp.launch.worker_lines import Pump
from tfdp.launch.worker_lines import CONSEQUENCES, WorkerLines

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

# Environment of every worker.
ENV_HEARTBEAT_FILE = "TFDP_HEARTBEAT_FILE"
ENV_RESTART_COUNT = goodput.ENV_RESTART_COUNT

POLL_SECONDS = 0.2
# How long the output of exited workers may still take to arrive.
_DRAIN_SECONDS = 2.0

class Launcher:
  """Starts, watches and stops one group of local worker processes.

  Every worker is the leader of its own session (so a signal reaches all of
  its processes, and a Ctrl-C in the launcher's terminal reaches the launcher
  only) and gets SIGKILL when the launcher dies (see `signals.die_with_parent`).

  Args:
    command: the argv of every worker.
    num_workers: how many workers.
    port: first port of the cluster, or None for free ports.
    env: environment of the workers (default: ours); TF_CONFIG is set per
      worker and TFDP_WORKER_INDEX, TFDP_NUM_WORKERS, TFDP_SLOT,
      TFDP_RESTART_COUNT, TFDP_HEARTBEAT_FILE and TFDP_ATTEMPT_START (the
      time of the spawn, for goodput accounting) are added.
    grace_seconds: time between SIGTERM and SIGKILL when stopping workers.
    out: where prefixed worker output goes (default: sys.stdout); a stream,
      or an `Output` shared with the caller.
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
    show_all: print every worker line as it comes; by default known TF
      noise and lines repeating another worker's are held back (see
      `worker_lines.WorkerLines`).
  """

  def __init__(self, command: Sequence[str], num_workers: int, *,
               port: Optional[int] = None,
               env: Optional[Mapping[str, str]] = None,
               grace_seconds: float = DEFAULT_GRACE_SECONDS,
               out: Union[TextIO, Output, None] = None,
               slots: Optional[Sequence[int]] = None,
               hosts: Optional[Sequence[str]] = None,
               wrapper: Optional[Sequence[str]] = None, attempt: int = 0,
               hang_timeout: float = 0.0,
               startup_timeout: Optional[float] = None,
               heartbeat_dir: Optional[str] = None,
               show_all: bool = False):
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
    self.output = out if isinstance(out, Output) else Output(out)
    self.out = self.output.stream
    self.wrapper = list(wrapper or [])
    self.attempt = attempt
    self.hang_timeout = hang_timeout or 0.0
    self.startup_timeout = (startup_timeout if startup_timeout is not None else
                            max(self.hang_timeout, DEFAULT_STARTUP_TIMEOUT))
    self._own_heartbeat_dir = heartbeat_dir is None
    self.heartbeat_dir = heartbeat_dir or tempfile.mkdtemp(prefix="tfdp-heartbeat-")
    self.procs = []
    self.heartbeat_files = []
    self.lines = WorkerLines(self.output, num_workers, show_all=show_all,
                             addresses=self.cluster["worker"])
    self._pumps = []
    self._stopping = False
    # A signal to the launcher, forwarded: later exits 0 and 75 are no failures.
    self.signalled = False
    self._term_signal = None  # sent to every worker, also to ones started later
    self._kill_at = None      # monotonic time of the SIGKILL that follows it
    self._grace = None        # the grace period that ends there
    self._killed = False
    # For goodput accounting (time.time()): the spawn, the failure's
    # detection, each worker's last heartbeat step then, the group's end.
    self.started_at = None
    self.failed_at = None
    self.steps_at_failure = []
    self.ended_at = None
    self.failure = None  # what `watch` returned

  def _argv(self, index):
    if not self.wrapper:
      return self.command
    host = self.hosts[index] if self.hosts else "localhost"
    return [w.format(slot=self.slots[index], index=index, host=host)
            for w in self.wrapper] + self.command

  def _worker_env(self, i):
    env = dict(self.env)
    env["TF_CONFIG"] = tf_config(self.cluster, i)
    env["TFDP_WORKER_INDEX"] = str(i)
    env["TFDP_NUM_WORKERS"] = str(self.num_workers)
    env["TFDP_SLOT"] = str(self.slots[i])
    env[ENV_RESTART_COUNT] = str(self.attempt)
    env[ENV_HEARTBEAT_FILE] = self.heartbeat_files[i]
    env[goodput.ENV_ATTEMPT_START] = repr(self.started_at)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env

  def start(self) -> None:
    """Starts every worker.

    Call it from a thread that outlives the workers, such as the main thread:
    Linux sends the parent-death signal when the starting thread ends.

    Raises:
      ConfigError: if a worker cannot be started (the others are stopped).
    """
    self.started_at = time.time()
    for i in range(self.num_workers):
      self.heartbeat_files.append(os.path.join(
          self.heartbeat_dir, f"attempt{self.attempt}-worker{i}.heartbeat"))
      try:
        proc = subprocess.Popen(
            self._argv(i), env=self._worker_env(i), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=signals.die_with_parent())
      except (OSError, subprocess.SubprocessError) as e:
        self.stop()
        raise errors.ConfigError(
            f"Cannot start worker {i} with command {self.command!r}: {e}") from e
      self.procs.append(proc)
      if self._term_signal is not None:  # a signal came while starting
        signals.kill_group(proc.pid, self._term_signal)
      pump = Pump(proc.stdout, i, self.lines)
      pump.start()
      self._pumps.append(pump)

  def signal_all(self, sig: int) -> None:
    """Sends `sig` to the process group of every live worker."""
    for proc in self.procs:
      if proc.poll() is None:
        signals.kill_group(proc.pid, sig)

  def terminate(self, sig: int = signal.SIGTERM,
                grace_seconds: Optional[float] = None) -> None:
    """Sends `sig` to every worker now; `watch`/`stop` SIGKILL them after the grace period.

    Safe in a signal handler (no output, no waiting). Workers started later
    by `start` get `sig` too; a second call can shorten the grace period,
    never lengthen it.
    """
    grace = self.grace_seconds if grace_seconds is None else grace_seconds
    deadline = time.monotonic() + max(0.0, grace)
    if self._kill_at is None or deadline < self._kill_at:
      self._kill_at, self._grace = deadline, grace
    self._term_signal = sig
    self.signal_all(sig)

  def forward(self, sig: int) -> None:
    """A signal the launcher got: sends it on; SIGKILL follows after `grace_seconds`.

    Safe in a signal handler. After it, exits with 0 or EXIT_PREEMPTED are
    the workers' answer to the signal, not failures.
    """
    self.signalled = True
    self.terminate(sig)

  def _enforce_grace(self, now: float) -> None:
    if self._kill_at is None or now < self._kill_at:
      return
    live = [i for i, p in enumerate(self.procs) if p.poll() is None]
    if live and not self._killed:
      self.log(f"worker(s) {', '.join(map(str, live))} still running "
               f"{self._grace:g} s after {signal.Signals(self._term_signal).name}; "
               "sending SIGKILL.")
    self._killed = True
    self.signal_all(signal.SIGKILL)

  @property
  def killed(self) -> bool:
    """True when workers were still running at the end of a grace period and got SIGKILL."""
    return self._killed

  def stop(self, sig: int = signal.SIGTERM,
           grace_seconds: Optional[float] = None) -> None:
    """Sends `sig` to every live worker, SIGKILL after the grace period; returns when all ended."""
    self._stopping = True
    self.terminate(sig, grace_seconds)
    while any(p.poll() is None for p in self.procs):
      self._enforce_grace(time.monotonic())
      time.sleep(0.05)
    self._kill_leftovers()

  def _kill_leftovers(self):
    # A worker's own children (left in its process group) go with it.
    for proc in self.procs:
      signals.kill_group(proc.pid, signal.SIGKILL)

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

  def last_steps(self) -> list[Optional[int]]:
    """Each worker's last heartbeat step (None: no heartbeat, or not a step)."""
    steps = []
    for i in range(len(self.heartbeat_files)):
      try:
        steps.append(int(self._last_step(i)))
      except (TypeError, ValueError):
        steps.append(None)
    return steps

  def _hung(self, codes, now, progress, seen, beaten):
    """The Failure of the first live worker past its heartbeat limit, or None."""
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
          what = f"worker {i} wrote no heartbeat within {limit:g} s of its start"
        return Failure("hang", self.slots[i], i, None, what)
    return None

  def _failed(self, codes):
    ended = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)
             and not (self.signalled and c == EXIT_PREEMPTED)]
    if not ended:
      return None
    i, code = first_failure(ended)
    kind = "preempted" if code == EXIT_PREEMPTED else "exit"
    return Failure(kind, self.slots[i], i, code, f"worker {i} {describe_exit(code)}")

  def watch(self, poll_seconds: float = POLL_SECONDS) -> Optional[Failure]:
    """Waits until every worker ended, or one failed; returns a Failure or None.

    On the first failure (non-zero exit, death by a signal, or no heartbeat
    for `hang_timeout` seconds) the other workers are stopped. A worker that
    exits with EXIT_PREEMPTED has saved with the others; they get the full
    grace period to finish. Exits after a forwarded signal are no failures
    when they are 0 or EXIT_PREEMPTED. Workers still running at the end of a
    grace period get SIGKILL.
    """
    started = time.monotonic()
    progress = [started] * self.num_workers
    seen = [None] * self.num_workers
    beaten = [False] * self.num_workers
    failure = None
    while True:
      self.output.flush()
      self.lines.tick()
      codes = self.codes()
      now = time.monotonic()
      if failure is None and not self._stopping and not self._killed:
        failure = self._failed(codes)
        if failure is None and self.hang_timeout > 0:
          failure = self._hung(codes, now, progress, seen, beaten)
        if failure is not None:
          self.failed_at, self.steps_at_failure = time.time(), self.last_steps()
          self.log(f"{failure.message}; stopping the other workers.")
          if failure.kind != "preempted":
            self.lines.blame(failure.index)
          self.stop(grace_seconds=(
              self.grace_seconds if failure.kind == "preempted" else
              min(self.grace_seconds, FAILED_GROUP_GRACE_SECONDS)))
          codes = self.codes()
      if all(c is not None for c in codes):
        self.ended_at = time.time()
        break
      self._enforce_grace(now)
      time.sleep(poll_seconds)
    self._kill_leftovers()
    deadline = time.monotonic() + _DRAIN_SECONDS
    for pump in self._pumps:
      pump.join(timeout=max(0.0, deadline - time.monotonic()))
    self.output.flush()
    # A worker that saved for a preemption (exit 75) did its part.
    self.lines.finish([0 if c == EXIT_PREEMPTED else c for c in self.codes()],
                      failed=failure is not None and failure.kind != "preempted")
    self.cleanup()
    self.failure = failure
    return failure

  def wait(self, poll_seconds: float = POLL_SECONDS) -> Optional[str]:
    """Waits for the group; returns None or a failure message.

    The first worker to exit non-zero stops the others; its failure is the
    one reported.
    """
    failure = self.watch(poll_seconds)
    return failure.message if failure else None

  def failure_lines(self, failure: Failure) -> list[str]:
    """One line per kind of failure, `worker N failed: <its error>`, the blamed worker's last.

    A worker's error is its last error line (Python's `Type: message`, a
    CLI's `prog: error: message`); without one, how it ended. Another worker
    counts when it printed an error and ended neither 0 nor as a consequence.
    Workers whose errors differ only in what differs between workers (see
    `worker_lines.same_text`) share a line.
    """
    codes = self.codes()
    kinds = {}  # the error as compared -> [its text, its workers]
    for i in [j for j in range(len(codes)) if j != failure.index] + [failure.index]:
      error, fatal = self.lines.error(i)
      if i == failure.index:
        code = codes[i]
        if failure.kind == "hang":
          error = failure.message.split(" ", 2)[2]
        elif code is not None and (code < 0 or not error):  # a signal: what killed it
          error = describe_exit(code).removeprefix("was ") + (f" ({fatal})" if fatal else "")
      elif codes[i] in (None, 0, EXIT_PEER_LOST, EXIT_PREEMPTED) or (
          error and error.startswith(CONSEQUENCES)):
        continue
      if error:
        key = self.lines.same(i, error)
        kind = kinds.pop(key, [error, []])  # popped: the blamed kind ends up last
        kinds[key] = [error if i == failure.index else kind[0], kind[1] + [i]]
    return [f"worker{'s' if len(workers) > 1 else ''} {','.join(map(str, sorted(workers)))} "
            f"failed: {text}" for text, workers in kinds.values()]

  def codes(self) -> list[Optional[int]]:
    """The exit code of every worker (None while running)."""
    return [p.poll() for p in self.procs]

  def cleanup(self) -> None:
    """Removes the heartbeat folder if this launcher made it."""
    if self._own_heartbeat_dir:
      shutil.rmtree(self.heartbeat_dir, ignore_errors=True)

  def log(self, msg: str) -> None:
    """Writes `[tfdp-launch] msg`."""
    self.output.log(msg)

  _log = log

