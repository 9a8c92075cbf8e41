"""The launcher's output: its own log lines and every worker's lines, prefixed, on one stream."""

import queue
import sys
import threading
from typing import Optional, TextIO


class Output:
  """The launcher's output stream, shared by its own log and the workers' prefixed lines.

  `later` may be called from a signal handler: it only queues the line
  (SimpleQueue.put is reentrant), and the main loop writes it with `flush`.
  A handler that wrote itself could interrupt a write to the same stream.
  """

  def __init__(self, stream: Optional[TextIO] = None):
    self.stream = stream or sys.stdout
    self._lock = threading.Lock()
    self._later = queue.SimpleQueue()

  def write_line(self, line: str) -> None:
    with self._lock:
      self.stream.write(line + "\n")
      self.stream.flush()

  def log(self, msg: str) -> None:
    """Writes `[tfdp-launch] msg` after any queued lines."""
    self.flush()
    self.write_line(f"[tfdp-launch] {msg}")

  def later(self, msg: str) -> None:
    """Queues `msg` for the next `log` or `flush`; safe in a signal handler."""
    self._later.put(msg)

  def flush(self) -> None:
    while True:
      try:
        msg = self._later.get_nowait()
      except queue.Empty:
        return
      self.write_line(f"[tfdp-launch] {msg}")


class Pump(threading.Thread):
  """Copies a worker's output to ours, one prefixed line at a time."""

  def __init__(self, stream, prefix: str, output: Output):
    super().__init__(daemon=True)
    self._stream, self._prefix, self._output = stream, prefix, output

  def run(self):
    for raw in iter(self._stream.readline, b""):
      line = raw.decode("utf-8", errors="replace").rstrip("\n")
      self._output.write_line(f"{self._prefix}{line}")
    self._stream.close()
