"""The restart loop of tfdp-launch: attempts of one worker group until it succeeds, is signalled or runs out of restarts."""

import dataclasses
import os
import re
import shutil
import signal
import tempfile
import time
from typing import Mapping, Optional, Sequence, TextIO

from tfdp import errors
from tfdp import goodput
from tfdp.launch import exits
from tfdp.launch import noise
from tfdp.launch import procs
from tfdp.launch import signals
from tfdp.launch.elastic import Slots
from tfdp.launch.output import Output

# Exit codes of tfdp-launch (and EXIT_PREEMPTED: signalled, the workers saved).
EXIT_OK = 0
# A worker failed (exited non-zero, was killed or hung) and no restart was
# left, or the workers did not answer a signal with 0 or EXIT_PREEMPTED; the
# message names the worker and, after restarts, lists every cause.
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
# A worker's last error line that names an error of the job's own settings
# (Python's `Type: message`, the type possibly qualified by its module).
_USER_ERROR = re.compile(r"(?:[\w.]+\.)?(?:ConfigError|IncompatibleCheckpointError): ")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
  """How `launch` runs and restarts a job; one field per flag of tfdp-launch.

  Attributes:
    port: first port (workers take consecutive ports); None picks free ports,
      new ones at every restart.
    grace_seconds: how long stopped workers get between SIGTERM (or the
      forwarded signal) and SIGKILL.
    max_restarts: how many times the whole group may be restarted after a
      worker exits non-zero, is killed or hangs.
    hang_timeout: seconds without a heartbeat (TFDP_HEARTBEAT_FILE) after
      which a worker counts as hung; 0 turns it off.
    startup_timeout: the limit before a worker's first heartbeat (default
      max(hang_timeout, 600)).
    elastic: leave out a slot that keeps failing (see `Slots`), down to
      `min_workers`, and take it back when it is healthy.
    min_workers: the fewest workers an elastic job runs with (default 1).
    slot_failures: blamed attempts in a row that make a slot "keep failing".
    slot_check: shell command, formatted with {slot} and {host}, that exits 0
      when a left-out slot may return.
    hosts: the address of each slot (default localhost for all).
    wrapper: argv prefix of each worker, formatted with {slot}, {index}, {host}.
    verbose_workers: print every worker line as it comes; by default (and
      unless TFDP_SHOW_TF_LOGS=1) known TF/gRPC noise is not printed (one
      line counts it when the job fails), and an error or line that several
      workers print is printed once (see `worker_lines.WorkerLines`).
  """
  port: Optional[int] = None
  grace_seconds: float = procs.DEFAULT_GRACE_SECONDS
  max_restarts: int = 0
  hang_timeout: float = 0.0
  startup_timeout: Optional[float] = None
  elastic: bool = False
  min_workers: Optional[int] = None
  slot_failures: int = 2
  slot_check: Optional[str] = None
  hosts: Optional[Sequence[str]] = None
  wrapper: Optional[Sequence[str]] = None
  verbose_workers: bool = False

  def check(self, num_workers: int) -> None:
    """Raises ConfigError, naming the flag, if these options cannot run `num_workers` workers."""
    min_workers = 1 if self.min_workers is None else self.min_workers
    problems = [
        (num_workers < 1, f"--num_workers must be >= 1, got {num_workers}"),
        (self.hosts is not None and len(self.hosts) != num_workers,
         f"--hosts names {len(self.hosts or ())} hosts for --num_workers={num_workers}; "
         "give one per worker"),
        (self.grace_seconds < 0, f"--grace_seconds must be >= 0, got {self.grace_seconds:g}"),
        (self.max_restarts < 0, f"--max_restarts must be >= 0, got {self.max_restarts}"),
        (self.hang_timeout < 0, f"--hang_timeout must be >= 0, got {self.hang_timeout:g}"),
        (self.elastic and not 1 <= min_workers <= num_workers,
         f"--min_workers must be in [1, {num_workers}] (--num_workers), got {min_workers}"),
        (self.slot_failures < 1, f"--slot_failures must be >= 1, got {self.slot_failures}"),
    ]
    for bad, message in problems:
      if bad:
        raise errors.ConfigError(message + ".")


def launch(command: Sequence[str], num_workers: int,
           env: Optional[Mapping[str, str]] = None, *,
           out: Optional[TextIO] = None, options: Optional[LaunchOptions] = None,
           **option_values) -> int:
  """Runs `command` as `num_workers` workers, restarting the group on failures.

  SIGINT and SIGTERM received by this process (in the main thread) are
  forwarded to every worker and end the restarts; workers still running
  `grace_seconds` later get SIGKILL.

  Args:
    command: argv list of each worker.
    num_workers: number of workers (slots).
    env: environment for the workers (default: this process's).
    out: stream for prefixed worker output (default: sys.stdout).
    options: a `LaunchOptions` (default: all defaults).
    **option_values: fields of `LaunchOptions` to set on top of `options`,
      e.g. `launch(cmd, 2, max_restarts=3, grace_seconds=5)`.

  Returns:
    EXIT_OK when every worker of an attempt exited 0, or exited 0 after a
    signal; EXIT_PREEMPTED when the launcher was signalled and the workers
    saved and exited with it; else EXIT_WORKER_FAILED.

  Raises:
    ConfigError: for invalid options, or a command that cannot be started.
  """
  options = dataclasses.replace(options or LaunchOptions(), **option_values)
  options.check(num_workers)
  return _Job(command, num_workers, env, options, out).run()


def _record_path(heartbeat_dir, attempt):
  return os.path.join(heartbeat_dir, f"attempt{attempt}.goodput.json")


class _Job:
  """One `launch`: the attempts, the signal that may end them, and the causes of each restart."""

  def __init__(self, command, num_workers, env, options, out):
    self.command, self.env, self.options = list(command), env, options
    self.output = Output(out)
    self.log = self.output.log
    keep = ((1 if options.min_workers is None else options.min_workers)
            if options.elastic else num_workers)
    self.slots = Slots(num_workers, keep, options.slot_failures,
                       options.slot_check, options.hosts, self.log)
    self.group = None
    self.signum = None
    self.causes = []
    # Each attempt as goodput.summarize takes it, the chief's record included,
    # and the attempts of earlier launches that the chief found in its ledger.
    self.goodput = []
    self.earlier_launches = []
    # The job's last lines: what failed (one line per kind of failure).
    self.final_lines = []

  def on_signal(self, signum):
    """The signal handler: records, forwards and queues a line; never blocks."""
    if self.signum is None:
      self.signum = signum
    self.output.later(
        f"received {signal.Signals(signum).name}; forwarding to workers (SIGKILL "
        f"after {self.options.grace_seconds:g} s); no more restarts.")
    if self.group is not None:
      self.group.forward(signum)

  def run(self):
    if "TF_CONFIG" in (os.environ if self.env is None else self.env):
      self.log(f"TF_CONFIG is set in the environment; each of the {len(self.slots.active)} "
               "workers gets its own instead (unset it to silence this).")
    heartbeat_dir = tempfile.mkdtemp(prefix="tfdp-heartbeat-")
    try:
      with signals.forwarding(self.on_signal):
        code = self._attempts(heartbeat_dir)
      for line in self.final_lines:  # last, where a terminal shows them
        self.log(line)
      return code
    finally:
      shutil.rmtree(heartbeat_dir, ignore_errors=True)
      self.output.flush()

  def _attempts(self, heartbeat_dir):
    attempt = 0
    while True:
      if self.options.elastic and attempt:
        self.slots.before_attempt()
      self.group = group = self._group(attempt, heartbeat_dir)
      # From here on a signal reaches this group, even while it starts.
      if self.signum is not None:
        name = signal.Signals(self.signum).name
        if self.causes:
          self.log(f"stopped by {name} before the restart; causes: "
                   + "; ".join(self.causes) + ".")
        else:
          self.log(f"stopped by {name} before the workers started.")
        return EXIT_WORKER_FAILED
      group.start()
      failure = group.watch()
      self._account(attempt, group, failure, heartbeat_dir)
      if self.signum is not None:
        return self._after_signal(group, failure)
      if self.options.elastic:
        self.slots.after_attempt()
        self.slots.record(failure)
      if failure is None:
        if attempt:
          self.log(f"job finished after {attempt} restart(s).")
        self._report_goodput()
        return EXIT_OK
      self.causes.append(f"attempt {attempt + 1}: {failure.message}")
      if attempt >= self.options.max_restarts or self._user_error(failure):
        code = self._give_up(attempt)
        self._report_goodput()
        return code
      attempt += 1
      self.log(f"restart {attempt}/{self.options.max_restarts}: {failure.message}; "
               "restarting the group from the newest intact checkpoint.")

  def _goodput_env(self, attempt, heartbeat_dir):
    """The workers' environment for `attempt`: its goodput record, history and high water."""
    env = dict(os.environ if self.env is None else self.env)
    history = os.path.join(heartbeat_dir, f"attempt{attempt}.history.json")
    goodput.write_json_atomic(history, {"attempts": self.goodput})
    env[goodput.ENV_HISTORY] = history
    env[goodput.ENV_FILE] = _record_path(heartbeat_dir, attempt)
    high_water = goodput.high_water(self.goodput)
    env.pop(goodput.ENV_HIGH_WATER, None)
    if high_water is not None:
      env[goodput.ENV_HIGH_WATER] = str(high_water)
    return env

  def _account(self, attempt, group, failure, heartbeat_dir):
    """Keeps what goodput accounting needs of an attempt that ended.

    The furthest step each worker reached comes from its progress file in
    the ledger the chief's record names (exact; the heartbeats lag).
    """
    record = goodput.read_json(_record_path(heartbeat_dir, attempt))
    if record:
      self.earlier_launches += record.pop("earlier", None) or []
    self.goodput.append({
        "attempt": attempt, "spawn": group.started_at,
        "end": (group.failed_at if failure is not None else group.ended_at) or time.time(),
        "failed": failure is not None,
        "heartbeat_steps": group.steps_at_failure if failure is not None else [],
        "progress_steps": goodput.progress_steps((record or {}).get("ledger"),
                                                 group.started_at),
        "record": record,
    })

  def _report_goodput(self):
    """Logs the goodput line and writes goodput.json, for a job whose workers kept records.

    It covers the attempts of earlier launches of the same directory too.
    """
    if not any(a["record"] for a in self.goodput):
      return  # not a tfdp training job (or one that never got as far)
    attempts = goodput.merge(self.earlier_launches, self.goodput)
    summary = goodput.summarize(attempts, time.time())
    self.log(goodput.summary_line(summary))
    goodput.write_summary(summary["directory"], summary)

  def _group(self, attempt, heartbeat_dir):
    o = self.options
    group = procs.Launcher(
        self.command, len(self.slots.active), port=o.port,
        env=self._goodput_env(attempt, heartbeat_dir),
        grace_seconds=o.grace_seconds, out=self.output, slots=self.slots.active,
        hosts=o.hosts, wrapper=o.wrapper, attempt=attempt,
        hang_timeout=o.hang_timeout, startup_timeout=o.startup_timeout,
        heartbeat_dir=heartbeat_dir,
        show_all=o.verbose_workers or noise.show_tf_logs())
    if attempt:
      self.log(f"attempt {attempt + 1}: starting {group.num_workers} worker(s) "
               f"(slots {group.slots}) at {', '.join(group.cluster['worker'])}.")
    return group

  def _after_signal(self, group, failure):
    codes = group.codes()
    if failure is None and all(c in (EXIT_OK, exits.EXIT_PREEMPTED) for c in codes):
      if exits.EXIT_PREEMPTED in codes:
        self.log(f"workers saved and exited after the signal; exit code "
                 f"{exits.EXIT_PREEMPTED}: run the same command again to resume.")
        return exits.EXIT_PREEMPTED
      return EXIT_OK
    if group.killed or failure is not None:
      why = ""  # the group has logged it ("... sending SIGKILL", "worker 1 exited ...")
    else:
      why = ": " + ", ".join(f"worker {i} {exits.describe_exit(c)}"
                             for i, c in enumerate(codes) if c)
    self.log(f"job failed after the signal{why}; exit code {EXIT_WORKER_FAILED}.")
    return EXIT_WORKER_FAILED

  def _user_error(self, failure) -> bool:
    """Whether `failure` is an error of the job's settings that every attempt would repeat.

    tfdp's ConfigError (a bad setting) and IncompatibleCheckpointError (a
    backup of another model): a restart cannot help, and the job exits
    EXIT_USAGE, as tfdp's CLIs do for them.
    """
    error = self.group.lines.error(failure.index)[0] if failure.kind == "exit" else None
    return bool(error) and _USER_ERROR.match(error) is not None

  def _give_up(self, attempt):
    # The group logged the failure when it happened; this line says what follows,
    # the job's last lines what failed.
    self.final_lines = self.group.failure_lines(self.group.failure)
    if self._user_error(self.group.failure):
      self.log(f"job failed on its settings or its backup; not restarting it; exit code "
               f"{EXIT_USAGE}.")
      return EXIT_USAGE
    if self.options.max_restarts:
      self.log(f"giving up after {attempt} restart(s) (--max_restarts="
               f"{self.options.max_restarts}); causes: " + "; ".join(self.causes)
               + f"; exit code {EXIT_WORKER_FAILED}.")
    else:
      self.log(f"job failed; exit code {EXIT_WORKER_FAILED}.")
    return EXIT_WORKER_FAILED
