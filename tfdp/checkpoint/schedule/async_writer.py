"""One background thread that runs checkpoint writes and hands their errors back."""

import atexit
import collections
import threading
import time
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
  """Runs at most one job at a time in its own daemon thread (started once, reused).

  `wait()` blocks until the running job ends and re-raises its exception in
  the caller's thread (once), so a failed background write is never lost.
  `cpu_seconds` holds the thread CPU time of the latest jobs, newest last.
  """

  def __init__(self):
    self._job = None
    self._busy = False
    self._error = None
    self._cond = threading.Condition()
    self._thread = None
    self.cpu_seconds = collections.deque(maxlen=16)
    _live.add(self)

  @staticmethod
  def _loop(ref, cond):
    """The thread: runs each job; ends once its writer is gone (it holds it only weakly)."""
    while True:
      with cond:
        while (writer := ref()) is not None and writer._job is None:  # pylint: disable=protected-access
          del writer
          cond.wait(1.0)
        if writer is None:
          return
        fn = writer._job  # pylint: disable=protected-access
        del writer
      cpu = time.thread_time()
      error = None
      try:
        fn()
      except BaseException as e:  # pylint: disable=broad-except
        error = e
      del fn
      with cond:
        writer = ref()
        if writer is None:
          return
        writer.cpu_seconds.append(time.thread_time() - cpu)
        if error is not None:
          writer._error = error  # pylint: disable=protected-access
        writer._job, writer._busy = None, False  # pylint: disable=protected-access
        cond.notify_all()
        del writer

  def submit(self, fn):
    """Waits for the previous job (raising its error), then starts `fn()`."""
    self.wait()
    with self._cond:
      if self._thread is None:
        self._thread = threading.Thread(target=self._loop, args=(weakref.ref(self), self._cond),
                                        name="tfdp-ckpt-writer", daemon=True)
        self._thread.start()
      self._job, self._busy = fn, True
      self._cond.notify_all()

  def running(self):
    return self._busy

  def wait(self):
    """Blocks until the current job is done; re-raises its error if it failed."""
    with self._cond:
      while self._busy:
        self._cond.wait()
      error, self._error = self._error, None
    if error is not None:
      raise error
