"""One writer per checkpoint directory: a lease naming the job's session, host and pid.

The chief takes the lease before it deletes or writes anything; the other
workers check that it names their agreed session. A lease held by someone
else is taken over only when it is stale:
  - its holder is this very process (a new manager replaces the old one:
    fit, then fit again; a fresh callback after an interrupt);
  - its holder ran on this host and its pid is dead (a crashed job, or
    `tfdp-launch --max_restarts` restarting after the old processes died);
  - its holder ran on another host and has not renewed its heartbeat for
    EXPIRY_S seconds.
"""

import dataclasses
import os
import socket
import threading
import time
import weakref

from absl import logging

from tfdp import errors
from tfdp.checkpoint.format import fs

# The holder renews its heartbeat this often; another host's lease expires
# once it is EXPIRY_S old.
RENEW_S = 10.0
EXPIRY_S = 60.0


@dataclasses.dataclass(frozen=True)
class Lease:
  """Who writes into a checkpoint directory."""
  session: str
  host: str
  pid: int
  heartbeat: float  # time.time() of the last renewal.

  def describe(self) -> str:
    age = time.time() - self.heartbeat
    return (f"job session {self.session} (host {self.host}, pid {self.pid}, "
            f"heartbeat {age:.0f}s ago)")


def read(path: str) -> Lease | None:
  """The lease at `path`, or None when there is none (or a torn one)."""
  d = fs.read_json(path)
  try:
    return Lease(str(d["session"]), str(d["host"]), int(d["pid"]), float(d["heartbeat"]))
  except (TypeError, KeyError, ValueError):
    return None


def _pid_alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def stale_reason(held: Lease, now: float) -> str | None:
  """Why `held` may be taken over by this process, or None when it may not."""
  host = socket.gethostname()
  if held.host == host and held.pid == os.getpid():
    return "held by this process (a new manager replaces the old one)"
  if held.host == host and not _pid_alive(held.pid):
    return f"its holder (pid {held.pid}) is no longer running"
  if held.host != host and now - held.heartbeat > EXPIRY_S:
    return f"its heartbeat is {now - held.heartbeat:.0f}s old (> {EXPIRY_S:.0f}s)"
  return None


def _busy(directory, held):
  return errors.CheckpointError(
      f"{directory} is in use by another {held.describe()}: one job writes into "
      "a checkpoint directory at a time. Stop that job, or use another "
      "directory.")


def acquire(path: str, session: str, directory: str) -> Lease:
  """Takes the lease at `path` for `session` (the chief, before any write).

  Raises:
    CheckpointError: another live job holds it (the message names its host
      and pid).
  """
  held = read(path)
  if held is not None and held.session != session:
    reason = stale_reason(held, time.time())
    if reason is None:
      raise _busy(directory, held)
    logging.info("tfdp: taking over the lease of %s: %s.", directory, reason)
  mine = Lease(session, socket.gethostname(), os.getpid(), time.time())
  fs.write_json_atomic(path, dataclasses.asdict(mine))
  return mine


def check(path: str, session: str, directory: str, timeout: float) -> Lease:
  """Waits until the lease at `path` names `session` (a non-chief worker).

  Raises:
    CheckpointError: after `timeout` seconds it names another job.
  """
  deadline = time.monotonic() + timeout
  while True:
    held = read(path)
    if held is not None and held.session == session:
      return held
    if time.monotonic() > deadline:
      if held is None:
        raise errors.CheckpointError(
            f"{directory} has no lease of this job (session {session}) after "
            f"{timeout:.0f}s: the chief did not start writing there. Check that "
            "every worker was given the same directory.")
      raise _busy(directory, held)
    time.sleep(0.05)


def release(path: str, session: str) -> None:
  """Removes the lease at `path` if it still names `session`."""
  held = read(path)
  if held is not None and held.session == session and held.pid == os.getpid():
    try:
      fs.remove(path)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: could not release the lease %s: %s", path, e)


def lost(directory: str, held: Lease | None, session: str) -> errors.CheckpointError:
  """The error of a writer whose lease another job took (fencing)."""
  who = held.describe() if held is not None else "nobody (the lease file is gone)"
  return errors.CheckpointError(
      f"{directory} is now held by {who}, not by this job (session {session}): this "
      "job lost its lease (its chief stalled past the lease's lifetime, or another "
      "job took the directory over) and does not write there any more. Stop one of "
      "the two jobs; the checkpoints committed there are the other job's.")


class Renewer:
  """Renews a lease's heartbeat every RENEW_S while `owner` lives and holds it.

  When it finds the lease taken over it stops, with an error in the log
  (`lost` says why); the next commit fails (Holder.check).
  """

  def __init__(self, path: str, lease: Lease, owner: object, directory: str = ""):
    self._stop = threading.Event()
    self.lost = None  # The lease that replaced this one, once found.
    ref = weakref.ref(owner)

    def body():
      while not self._stop.wait(RENEW_S) and ref() is not None:
        held = read(path)
        if self._stop.is_set():
          return
        if held is None or held.session != lease.session or held.pid != lease.pid:
          self.lost = held
          if held is not None and held.host == lease.host and held.pid == lease.pid:
            return  # A new manager of this process replaced this one.
          logging.error("tfdp: %s", lost(directory or os.path.dirname(path), held,
                                          lease.session))
          return
        try:
          fs.write_json_atomic(path, dataclasses.asdict(
              dataclasses.replace(lease, heartbeat=time.time())))
        except Exception as e:  # pylint: disable=broad-except
          logging.warning("tfdp: could not renew the lease %s: %s", path, e)

    self._thread = threading.Thread(target=body, name="tfdp-ckpt-lease", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Stops renewing; when it returns no renewal is in flight (so a release stays released)."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join()


class Holder:
  """The chief's hold on a directory: the lease taken before any write, renewed, released by `release()`.

  Args:
    path: the lease file.
    session: this job's session.
    directory: the checkpoint directory (for messages).
    lease: a lease already taken (by `tfdp.checkpoint.persistent.session.start`), or None.
  """

  def __init__(self, path: str, session: str, directory: str, lease: Lease | None = None):
    self._path, self._session, self._directory = path, session, directory
    self._renewer = Renewer(path, lease, self, directory) if lease is not None else None

  @property
  def held(self) -> bool:
    return self._renewer is not None

  def ensure(self) -> None:
    """Takes the lease again when released (a save after close())."""
    if self._renewer is None:
      lease = acquire(self._path, self._session, self._directory)
      self._renewer = Renewer(self._path, lease, self, self._directory)

  def check(self) -> None:
    """The fence, just before a commit point: raises unless the lease still names this job.

    Raises:
      CheckpointError: another job holds the directory now (the message names it).
    """
    held = read(self._path)
    if held is None or held.session != self._session or held.pid != os.getpid():
      raise lost(self._directory, held, self._session)

  def release(self) -> None:
    if self._renewer is not None:
      self._renewer.stop()
      self._renewer = None
      release(self._path, self._session)
