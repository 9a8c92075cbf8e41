"""A multi-worker job's start-up: waits for the peers in Python, saying whom it waits for; Ctrl-C, SIGTERM and a deadline end the wait."""

import os
import signal
import socket
import sys
import threading
import time

from absl import logging

from tfdp.distribute import environment
from tfdp import errors

# While peers are missing, a worker names them this often (seconds; env
# TFDP_STARTUP_REPORT_SECONDS overrides it).
REPORT_SECONDS = 30.0
REPORT_ENV = "TFDP_STARTUP_REPORT_SECONDS"
# Seconds a worker waits for its peers before it gives up (unset: no limit).
TIMEOUT_ENV = "TFDP_STARTUP_TIMEOUT"
# As a CLI's usage error: nothing trained, the job as given cannot start.
EXIT_STARTUP = 2
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NAMED = 8  # Peers named in one line; more are counted.
_POLL_S = 0.2


def _seconds(env: str, default: float | None) -> float | None:
  raw = os.environ.get(env, "").strip()
  if not raw:
    return default
  try:
    value = float(raw)
  except ValueError:
    value = 0.0
  if value <= 0:
    raise errors.ConfigError(f"{env}={raw!r}: set it to a positive number of seconds.")
  return value


def startup_timeout(given: float | None) -> float | None:
  """The start-up deadline: `given` (make_strategy's argument), else env TFDP_STARTUP_TIMEOUT, else None.

  Raises:
    ConfigError: a value that is not a positive number of seconds.
  """
  if given is not None:
    if given <= 0:
      raise errors.ConfigError(
          f"startup_timeout_seconds must be positive, got {given!r}.")
    return float(given)
  return _seconds(TIMEOUT_ENV, None)


def tasks_of(config: dict | None) -> tuple[str | None, list[tuple[int, str]]]:
  """(this task's address, [(tfdp worker index, address)] of the other training tasks) of a parsed TF_CONFIG."""
  if not config:
    return None, []
  cluster = config["cluster"]
  task_type, task_id = environment.own_task(config)
  own, peers = None, []
  for job in environment.TASK_TYPES:
    for i, address in enumerate(cluster.get(job, [])):
      if (job, i) == (task_type, int(task_id or 0)):
        own = address
      else:
        peers.append((environment.worker_index(job, i, cluster), address))
  return own, sorted(peers)


def describe(peers) -> str:
  """'worker 1 (host:port), worker 2 (...)', the first few named."""
  named = ", ".join(f"worker {i} ({a})" for i, a in peers[:_NAMED])
  rest = len(peers) - _NAMED
  return named + (f" and {rest} more" if rest > 0 else "")


def _split(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def _listen(address: str | None):
  """A listener on this task's port until TF's server takes it over, so that the peers see this one started."""
  try:
    return socket.create_server(("", _split(address)[1]), backlog=64)
  except (OSError, ValueError, TypeError, AttributeError):
    return None  # Busy or unparsable: TF's own start-up will say so.


def _reachable(address: str) -> bool:
  try:
    with socket.create_connection(_split(address), timeout=1.0):
      return True
  except (OSError, ValueError):
    return False


class _Interrupted(Exception):
  pass


def _interrupt(signum, _frame):
  raise _Interrupted(signum)


def _fail(line: str) -> None:
  logging.error("%s", line)
  sys.stdout.flush()
  sys.stderr.flush()
  raise SystemExit(EXIT_STARTUP)


def wait_for_peers(config: dict | None, timeout: float | None = None) -> None:
  """Returns once every other worker of `config` listens on its port; says whom it waits for meanwhile.

  TensorFlow waits for the peers inside C++ holding Python's lock, so no
  signal handler runs and nothing can be said while it waits. So this
  worker waits first, in Python: it listens on its own port of TF_CONFIG
  (where TF's server listens later) and connects to each peer's until all
  answer (their listener, or their TF server once started). Every
  REPORT_SECONDS it logs the workers still missing and their addresses;
  SIGINT, SIGTERM and the `timeout` end the process with one line and exit
  code 2. Outside the main thread, or when this task's port cannot be
  taken, it returns at once (TF then waits as before).

  Args:
    config: the parsed TF_CONFIG (or SLURM's, as tfdp.distribute.environment gives it).
    timeout: seconds before the wait fails (None: no limit).
  """
  own, missing = tasks_of(config)
  if not missing or threading.current_thread() is not threading.main_thread():
    return
  report = _seconds(REPORT_ENV, REPORT_SECONDS)
  listener = _listen(own)
  if listener is None:
    return
  previous = {s: signal.signal(s, _interrupt) for s in _SIGNALS}
  start = time.monotonic()
  next_report = start + report
  try:
    while True:
      missing = [(i, a) for i, a in missing if not _reachable(a)]
      if not missing:
        return
      now = time.monotonic()
      if timeout is not None and now - start >= timeout:
        _fail(f"tfdp: {describe(missing)} did not start within {timeout:.0f} s (the "
              f"start-up deadline, {TIMEOUT_ENV} or make_strategy(startup_timeout_seconds=)): "
              "check that they were started and that TF_CONFIG names their hosts and "
              f"ports; exiting with code {EXIT_STARTUP}.")
      if now >= next_report:
        logging.warning("tfdp: waiting for %s to start (%.0f s so far): check that they "
                        "were started and that TF_CONFIG names their hosts and ports.",
                        describe(missing), now - start)
        next_report += report
      time.sleep(_POLL_S)
  except _Interrupted as e:
    _fail(f"tfdp: {signal.Signals(e.args[0]).name} while waiting for {describe(missing)} to "
          f"start ({time.monotonic() - start:.0f} s); exiting with code {EXIT_STARTUP}.")
  finally:
    listener.close()
    for s, handler in previous.items():
      signal.signal(s, handler)
