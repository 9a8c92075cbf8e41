"""Signals between the launcher and its workers: SIGINT/SIGTERM forwarded, the parent-death signal, a group's kill."""

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional, Sequence

FORWARDED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def forwarding(handler: Callable[[int], None],
               signals: Sequence[int] = FORWARDED) -> Iterator[bool]:
  """Calls `handler(signum)` for each of `signals` inside the block; restores the old handlers after.

  Python runs signal handlers in the main thread only, so from any other
  thread this installs nothing (the block then runs with the process's
  handlers) and yields False.

  `handler` runs between two bytecodes of the main thread, possibly in the
  middle of a write or a lock the main thread holds: it should only record
  the signal, send signals on and queue output (see `output.Output.later`).

  Args:
    handler: called with the signal number.
    signals: the signals to route to it.

  Yields:
    True when the handlers are installed.
  """
  if threading.current_thread() is not threading.main_thread():
    yield False
    return
  previous = {}
  try:
    for sig in signals:
      previous[sig] = signal.signal(sig, lambda signum, _frame: handler(signum))
    yield True
  finally:
    for sig, old in previous.items():
      signal.signal(sig, old)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _prctl():
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None


_PRCTL = _prctl()


def die_with_parent() -> Optional[Callable[[], None]]:
  """A `preexec_fn` that SIGKILLs the worker when the launcher dies, by any signal.

  Linux's parent-death signal fires when the *thread* that forked the child
  ends, so workers must be started from a thread that lives as long as the
  launcher (the main thread). If the launcher died between the fork and the
  prctl, the child has a new parent already and kills itself. Elsewhere than
  Linux there is no such signal and this returns None.
  """
  if _PRCTL is None:
    return None
  parent, prctl, sigkill = os.getpid(), _PRCTL, int(signal.SIGKILL)

  def preexec():  # runs in the child between fork and exec: no imports, no I/O
    prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
    if os.getppid() != parent:
      os.kill(os.getpid(), sigkill)
  return preexec


def kill_group(pgid: int, sig: int) -> None:
  """Sends `sig` to the process group `pgid`, if it still exists."""
  try:
    os.killpg(pgid, sig)
  except (ProcessLookupError, PermissionError):
    pass
