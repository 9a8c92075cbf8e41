"""One background thread that runs checkpoint writes and hands their errors back."""

import atexit
import threading
import weakref

from absl import logging

_live = weakref.WeakSet()


@atexit.register
def _wait_all_at_exit():
  for writer in list(_live):
    try:
      writer.wait()
    except Exception as e:  # pylint: disable=broad-except
      logging.error("tfdp: a background checkpoint write failed at exit: %s", e)


class AsyncWriter:
  """Runs at most one job at a time in a daemon thread.

  `wait()` blocks until the running job ends and re-raises its exception in
  the caller's thread (once), so a failed background write is never lost.
  """

  def __init__(self):
    self._thread = None
    self._error = None
    self._lock = threading.Lock()
    _live.add(self)

  def submit(self, fn):
    """Waits for the previous job (raising its error), then starts `fn()`."""
    self.wait()

    def body():
      try:
        fn()
      except BaseException as e:  # pylint: disable=broad-except
        with self._lock:
          self._error = e

    self._thread = threading.Thread(target=body, name="tfdp-ckpt-writer",
                                    daemon=True)
    self._thread.start()

  def running(self):
    return self._thread is not None and self._thread.is_alive()

  def wait(self):
    """Blocks until the current job is done; re-raises its error if it failed."""
    thread = self._thread
    if thread is not None:
      thread.join()
      self._thread = None
    with self._lock:
      error, self._error = self._error, None
    if error is not None:
      raise error
