"""The messages a restore waits for on the side channel: registered before the agreement, each accepted once, from its one sender."""

import threading

START_S = 20.0  # A restore's sender must start sending within this, after the agreement.


class _Expected:
  """One message a restore waits for: whether it started, and what arrived (or why not)."""

  def __init__(self):
    self.started = threading.Event()
    self.done = threading.Event()
    self.result = None
    self.error = None

  def finish(self, result=None, error=None):
    self.result, self.error = result, error
    self.done.set()


class Awaited:
  """The messages this worker's restore waits for, by (kind, step, sender).

  The restore registers each (`expect`) before the agreement that lets its
  sender send; a side-channel thread takes it (`start`) as its header
  arrives, once, and finishes it; the restore `wait`s for it.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._expected = {}  # (kind, step, sender) -> _Expected
    self._closed = False

  def expect(self, kind: str, step: int, sender: int) -> tuple:
    """Registers a message a restore waits for; returns its key."""
    key = (kind, step, sender)
    with self._lock:
      self._expected[key] = _Expected()
    return key

  def forget(self, key: tuple) -> None:
    """Unregisters a message `expect` registered and nobody will send."""
    with self._lock:
      self._expected.pop(key, None)

  def start(self, key: tuple) -> _Expected | None:
    """The registered message `key` whose header just arrived (None: not expected, or arrived already)."""
    with self._lock:
      expected = self._expected.get(key)
      if expected is None or expected.started.is_set():
        return None
      expected.started.set()
      return expected

  def wait(self, key: tuple, start_timeout: float = START_S):
    """The result the side channel finished message `key` with.

    Raises:
      TimeoutError: its sender did not start within `start_timeout`.
      ConnectionError: the side channel was closed.
      Whatever the side channel finished it with (it did not arrive whole).
    """
    with self._lock:
      expected = self._expected[key]
    kind, step, sender = key
    try:
      if not expected.started.wait(start_timeout):
        raise TimeoutError(f"worker {sender} did not start sending the {kind} of step {step} "
                           f"within {start_timeout:.0f}s")
      while not expected.done.wait(1.0):
        if self._closed:
          raise ConnectionError("the side channel was closed")
      if expected.error is not None:
        raise expected.error
      return expected.result
    finally:
      self.forget(key)

  def close(self) -> None:
    """Ends every wait: the side channel was closed."""
    with self._lock:
      self._closed = True
      expected = list(self._expected.values())
    for e in expected:
      e.finish(error=ConnectionError("the side channel was closed"))
