"""The local tier's writer queue: one save written at a time in a thread of its own, the newest one waiting."""

import threading

from absl import logging

from tfdp.checkpoint.schedule import async_writer


class SaveQueue:
  """Writes the local saves one at a time, in a background thread; training never waits for a write.

  A save put while another is being written waits for it in the queue; a
  newer one put meanwhile takes its place (counted in `skipped`), so the
  newest save due is written next. (With several workers the tier waits
  for the write in progress before it puts the next: see `LocalTier.save`.)

  Args:
    write: `fn(*job)`: writes one save (in the writer thread).
  """

  def __init__(self, write):
    self._write = write
    self._writer = async_writer.AsyncWriter()
    self._lock = threading.Lock()
    self._writing = False  # A save is being written; the next one waits in `_pending`.
    self._pending = None
    self.skipped = 0  # Saves never written: replaced while waiting, or no slot to fill.

  @property
  def cpu_seconds(self):
    """The writer thread's CPU seconds of the latest saves, newest last."""
    return self._writer.cpu_seconds

  def busy(self) -> bool:
    """Whether a save is being written (a new one would wait for it)."""
    return self._writing

  def skip(self) -> None:
    """Counts a save not written (the writer found no slot it may fill)."""
    with self._lock:
      self.skipped += 1

  def put(self, job: tuple) -> None:
    """Writes `job` in the background: now, or after the save being written (in place of one waiting)."""
    with self._lock:
      if self._writing:
        self.skipped += self._pending is not None
        self._pending = job
        return
      self._writing = True
    self.wait()  # A failed save before this one is logged here; training goes on.
    self._writer.submit(lambda: self._drain(job))

  def _drain(self, job):
    """The writer thread: writes `job`, then whatever save came meanwhile."""
    error = None
    while job is not None:
      try:
        self._write(*job)
      except Exception as e:  # pylint: disable=broad-except
        error = error or e
      with self._lock:
        job, self._pending = self._pending, None
        self._writing = job is not None
    if error is not None:
      raise error

  def wait(self) -> None:
    """Waits for the background save; a failed one is logged (training goes on)."""
    try:
      self._writer.wait()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdp: a local checkpoint save failed (training goes on; the "
                      "persistent tier is not affected): %s", e)
