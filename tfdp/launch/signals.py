"""Signal forwarding: SIGINT/SIGTERM to the launcher go to a handler for as long as a block runs."""

import contextlib
import signal
import threading
from typing import Callable, Iterator, Sequence

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
  the signal, send signals on and queue output (see `procs.Output.later`).

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
