"""The launcher's one output stream: its own log, workers' lines as WorkerLines passes them, the chief's progress bar."""

import queue
import re
import shutil
import sys
import threading
import time
from typing import Optional, TextIO

# How often the chief's progress bar (`\r` redraws) is forwarded; in a file each one stays.
BAR_SECONDS_TTY = 0.25
BAR_SECONDS_FILE = 1.0

# Keras colours its bar; a colour code takes no room on the screen.
_ANSI = re.compile(r"(\x1b\[[0-9;]*[A-Za-z])")


class _Bar:
  """The chief's progress bar: its latest redraw, and whether it is on the screen."""

  def __init__(self, index, now):
    self.index, self.since = index, now
    self.text, self.drawn_at = "", None
    self.pending = False  # a redraw not written yet
    self.shown = False    # a redraw ends the current line of the stream (no newline after it)
    self.live = True      # its line has not ended


class Output:
  """The launcher's output stream, shared by its own log and the workers' prefixed lines.

  `later` may be called from a signal handler: it only queues the line
  (SimpleQueue.put is reentrant), and the main loop writes it with `flush`;
  a handler that wrote itself could interrupt a write to the same stream.
  The chief's progress bar (`bar`) is redrawn in place, at most every
  `bar_seconds`; other lines go above it on a terminal, after it in a file.
  """

  def __init__(self, stream: Optional[TextIO] = None, bar_seconds: Optional[float] = None):
    self.stream = stream or sys.stdout
    # Reentrant: WorkerLines decides and writes under it.
    self.lock = threading.RLock()
    self._later = queue.SimpleQueue()
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self.bar_seconds = (bar_seconds if bar_seconds is not None else
                        BAR_SECONDS_TTY if self.tty else BAR_SECONDS_FILE)
    self._bar = None

  def _write(self, text):
    self.stream.write(text)
    self.stream.flush()

  def write_line(self, line: str, index: Optional[int] = None) -> None:
    """Writes `line` (of worker `index`, None: the launcher's) and a newline."""
    with self.lock:
      bar = self._bar
      if bar is None or not bar.shown:
        self._bar = None if bar is not None and bar.index == index else bar
        self._write(line + "\n")
      elif bar.index == index:  # the bar's own line replaces it
        self._bar = None
        self._write(("\r\x1b[K" if self.tty else "\r") + line + "\n")
      elif not bar.live:  # a bar whose line is not coming stays as it was
        self._bar = None
        self._write("\n" + line + "\n")
      elif self.tty:
        self._write("\r\x1b[K" + line + "\n" + self._fit(bar.text))
      else:
        bar.shown = False
        self._write("\n" + line + "\n")

  @staticmethod
  def _fit(text):
    """`text` cut to the terminal's width (a wrapped line cannot be redrawn), colour codes kept."""
    room, parts = max(shutil.get_terminal_size().columns - 1, 20), []
    for part in _ANSI.split(text):
      parts.append(part if _ANSI.fullmatch(part) else part[:room])
      room -= 0 if _ANSI.fullmatch(part) else len(parts[-1])
    return "".join(parts) + ("\x1b[0m" if "\x1b[" in text else "")

  def bar(self, index: int, text: str, now: Optional[float] = None) -> None:
    """Takes the latest redraw of worker `index`'s progress bar; writes it when due."""
    now = time.monotonic() if now is None else now
    with self.lock:
      if self._bar is None or self._bar.index != index or not self._bar.live:
        if self._bar is not None:
          self.end_bar(self._bar.index, keep=True)
        self._bar = _Bar(index, now)
      self._bar.text, self._bar.pending = text, True
      self.tick(now)

  def tick(self, now: Optional[float] = None) -> None:
    """Writes the bar's latest redraw if it is due: `bar_seconds` after the bar began and after the last one."""
    now = time.monotonic() if now is None else now
    with self.lock:
      bar = self._bar
      if (bar is None or not bar.pending or not bar.live or now - bar.since < self.bar_seconds
          or (bar.drawn_at is not None and now - bar.drawn_at < self.bar_seconds)):
        return
      redraw = ("\r\x1b[K" if self.tty else "\r") if bar.shown else ""
      self._write(redraw + (self._fit(bar.text) if self.tty else bar.text))
      bar.shown, bar.pending, bar.drawn_at = True, False, now

  def end_bar(self, index: Optional[int], keep: bool = False) -> None:
    """Worker `index`'s bar ended: its line follows (it replaces the bar), or with `keep` the bar stays as it is."""
    with self.lock:
      bar = self._bar
      if bar is not None and bar.index == index and (keep or not bar.shown):
        self._bar = None
        self._write("\n" if bar.shown else "")
      elif bar is not None and bar.index == index:
        bar.live = False

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
