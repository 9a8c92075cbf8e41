"""Every worker's lines on their way to the Output: prefixed, repeats printed once, TF noise held back, each worker's error recognised.

`Pump` reads one worker's output (a thread per stream); `WorkerLines`
decides what of it is printed, when, and under which `[worker i]` prefix.
"""

import codecs
import re
import threading
import time
from typing import Optional, Sequence

from tfdp.launch.noise import ABSL as _ABSL, ENV_SHOW_TF_LOGS, noise_kind
from tfdp.launch.output import Output

# A line that repeats one another worker printed is held this long at most,
# waiting to see whether its worker fails (then it is not printed again).
REPEAT_HOLD_SECONDS = 3.0

# An error block (a traceback, a usage error) is held this long at most, so that
# the same block of other workers is printed with it once (TF's teardown is slow).
BLOCK_HOLD_SECONDS = 5.0

# Errors a worker gets because another one is gone (its collectives abort): a
# consequence of the blamed failure, not a failure of its own.
CONSEQUENCES = ("UnavailableError", "AbortedError", "CancelledError", "DeadlineExceededError")

# How to see what a "held back" line counts.
_SHOW_THEM = f"--verbose_workers or {ENV_SHOW_TF_LOGS}=1 shows them"

# Lines seen per attempt, to recognise a repeat; older ones are forgotten.
_SEEN_KEPT = 4096

# What differs between workers that print the same thing: absl's time, pid and
# thread; the worker's own index and address; random temp names and object
# addresses. Another worker's index, or any other number, still differs.
_ABSL_HEADER = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ ")
_PER_PROCESS = ((re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x?"),
                (re.compile(r"\btmp[a-z0-9_]{8}\b"), "tmp?"),
                (re.compile(r"\b(pid[ =:]?)\d+\b", re.I), r"\1?"))


def same_text(text: str, index: int, address: Optional[str] = None) -> str:
  """`text` of worker `index` with what differs from worker to worker for the same event replaced."""
  text = _ABSL_HEADER.sub(r"\1 ", text, count=1)
  if address:
    text = text.replace(address, "<address>")
  text = re.sub(rf"\b(worker|task)([ _:=-]?){index}\b", r"\1\2<self>", text, flags=re.I)
  for pattern, by in _PER_PROCESS:
    text = pattern.sub(by, text)
  return text


# A worker's error, as its last line says it: Python's traceback ends with
# `Type: message`; argparse and tfdp's CLIs print `prog: error: message`;
# absl's FATAL (F...) line comes before a SIGABRT.
_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION = re.compile(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?::.*)?)")
_USAGE_ERROR = re.compile(r"[\w.-]+: error: (.+)")
_FATAL = re.compile(_ABSL.format(levels="F") + r"\S+\] (.+)")
_BLOCK_START = re.compile(re.escape(_TRACEBACK) + r"|usage: .*|" + _USAGE_ERROR.pattern)


def _one_line(message, limit=500):
  return message.strip()[:limit]


# An absl record written (to stderr) while a progress bar (on stdout) had no newline.
_GLUED = re.compile(_ABSL.format(levels="[IWEF]") + r"[\w.-]+:\d+\] ")


def _overwritten(text):
  """(bar, line): what a terminal shows of a line with `\\r` redraws, the text after the last one.

  A log record that follows a redraw on the same line is the line; the
  redraw before it is the bar, which goes on after it.
  """
  text = text.rstrip("\r")
  redraw = text.rfind("\r")
  if redraw < 0:
    return None, text
  text = text[redraw + 1:]
  glued = _GLUED.search(text, 1)
  return (text[:glued.start()], text[glued.start():]) if glued else (None, text)


class _Worker:
  """What WorkerLines holds back of one worker, and its last error."""

  def __init__(self):
    self.noise = 0              # noise lines held back (never printed)
    self.last_noise = None      # the Noise of this worker's previous line, if it was one
    self.repeats = []           # (line, the worker it repeats)
    self.repeats_since = None   # monotonic time of the first held repeat
    self.block = None           # the lines of an error block, held
    self.block_since = None
    self.in_traceback = False
    self.error = None           # the message of its last error
    self.fatal = None           # its last absl FATAL line
    self.after = []             # its lines after another worker failed the group, held

  def track(self, text):
    """Notes the error that `text` ends, if any."""
    if text == _TRACEBACK:
      self.in_traceback = True
    elif self.in_traceback and text and not text[0].isspace():
      match = _EXCEPTION.fullmatch(text)
      if match:  # else a line of another thread; the exception line follows
        self.error, self.in_traceback = _one_line(match.group(1)), False
    elif (match := _USAGE_ERROR.fullmatch(text)) is not None:
      self.error = _one_line(match.group(1))
    elif (match := _FATAL.fullmatch(text)) is not None:
      self.fatal = _one_line(match.group(1))


class WorkerLines:
  """The lines of one group of workers, on their way to an `Output`.

  Held back instead of printed as they come (with `show_all`, nothing is):
  - known TF/gRPC noise (`NOISE`): never printed; counted in one line when
    the worker or the group fails;
  - error blocks (a traceback or usage error, and the worker's lines after it):
    printed once with the same block of every other worker (`[workers 0,1]`),
    when the group ends or BLOCK_HOLD_SECONDS after the block began;
  - lines that repeat another worker's: printed when the worker prints a line
    of its own, after REPEAT_HOLD_SECONDS, or when it exits 0; not when it fails.
  "The same" ignores what differs between workers for one event (`same_text`).
  - after another worker failed the group (`blame`), a worker's new lines:
    what a lost peer does to its collectives (TF's abort logs, an
    UnavailableError traceback) is counted in one line; an error of its own
    is printed when the group ends.
  Worker 0's progress bar (`partial`) is forwarded as it redraws.
  """

  def __init__(self, output: Output, num_workers: int, show_all: bool = False,
               addresses: Optional[Sequence[str]] = None):
    self._output = output
    self._show_all = show_all
    self._workers = [_Worker() for _ in range(num_workers)]
    self._addresses = list(addresses or [None] * num_workers)
    # hash(same line) -> the first worker that printed it; a line can be 100s of KB.
    self._seen = {}
    self._blocks_printed = {}  # the key of a printed block -> its workers
    self._finished = False
    self._blamed = None  # the worker whose failure stopped the group

  def same(self, index: int, text: str) -> str:
    """`text` of worker `index` as compared with other workers' (see `same_text`)."""
    return same_text(text, index, self._addresses[index])

  @staticmethod
  def _prefix(indices):
    return (f"[worker {indices[0]}] " if len(indices) == 1 else
            f"[workers {','.join(map(str, indices))}] ")

  def _write(self, index, text):
    self._output.write_line(self._prefix([index]) + text, index)

  def add(self, index: int, text: str) -> None:
    """Takes one line (no newline) of worker `index`; called by its Pump."""
    with self._output.lock:
      self._output.end_bar(index)
      worker = self._workers[index]
      worker.track(text)
      if self._show_all or self._finished:
        self._write(index, text)
        return
      kind = noise_kind(worker.last_noise, text)
      worker.last_noise = kind
      if kind is not None:
        worker.noise += 1
        return
      if worker.block is not None:
        worker.block.append(text)
        return
      if self._blamed is not None and index != self._blamed:
        worker.after.append(text)
        return
      if _BLOCK_START.fullmatch(text):
        worker.block, worker.block_since = [text], time.monotonic()
        return
      key = hash(self.same(index, text))
      first = self._seen.get(key)
      if first is not None and first != index:
        if not worker.repeats:
          worker.repeats_since = time.monotonic()
        worker.repeats.append((text, first))
        return
      self._release(index)
      self._write(index, text)
      if first is None:
        if len(self._seen) >= _SEEN_KEPT:
          del self._seen[next(iter(self._seen))]
        self._seen[key] = index

  def partial(self, index: int, text: str) -> None:
    """Takes a redraw (after `\\r`) of worker `index`'s current line: the chief's is forwarded."""
    if index == 0:
      self._output.bar(index, self._prefix([index]) + text)

  def blame(self, index: int) -> None:
    """Worker `index` failed the group: the others' new lines are held (see the class)."""
    with self._output.lock:
      self._blamed = index

  def _after_the_failure(self):
    """Prints the held lines of workers with an error of their own; counts the rest."""
    held = {}
    for index, worker in enumerate(self._workers):
      if not worker.after:
        continue
      if worker.error and not worker.error.startswith(CONSEQUENCES):
        for text in worker.after:
          self._write(index, text)
      else:
        held[index] = len(worker.after)
      worker.after = []
    if held:
      n = sum(held.values())
      self._output.log(
          f"{n} line{'s' if n > 1 else ''} of worker{'s' if len(held) > 1 else ''} "
          f"{','.join(map(str, held))} after worker {self._blamed} failed held back (collectives "
          f"aborted without it); {_SHOW_THEM}")

  def closed(self, index: int) -> None:
    """Worker `index`'s output ended: a progress bar of it stays as it was."""
    self._output.end_bar(index, keep=True)

  def error(self, index: int) -> tuple[Optional[str], Optional[str]]:
    """Worker `index`'s last error message (`Type: message`) and absl FATAL message, or None."""
    return self._workers[index].error, self._workers[index].fatal

  def _release(self, index):
    worker = self._workers[index]
    for text, _ in worker.repeats:
      self._write(index, text)
    worker.repeats, worker.repeats_since = [], None

  def _block_key(self, index):
    return tuple(self.same(index, text) for text in self._workers[index].block)

  def _print_block(self, index):
    """Prints worker `index`'s block once with the same blocks of the others."""
    key = self._block_key(index)
    group = [i for i, w in enumerate(self._workers)
             if w.block is not None and (i == index or self._block_key(i) == key)]
    for i in group:  # what a worker printed before its block comes first
      self._release(i)
    lines, earlier = self._workers[index].block, self._blocks_printed.get(key)
    if earlier is not None:
      lines = [f"(the same {len(lines)} line(s) as {self._prefix(earlier)[1:-2]}'s above)"]
    for text in lines:
      self._output.write_line(self._prefix(group) + text, index if len(group) == 1 else None)
    self._blocks_printed.setdefault(key, group)
    for i in group:
      self._workers[i].block = self._workers[i].block_since = None

  def tick(self, now: Optional[float] = None) -> None:
    """Prints what was held long enough (repeats, error blocks) and the bar's redraw; called by the watch loop."""
    now = time.monotonic() if now is None else now
    with self._output.lock:
      for index, worker in enumerate(self._workers):
        if worker.repeats and now - worker.repeats_since >= REPEAT_HOLD_SECONDS:
          self._release(index)
        if worker.block is not None and now - worker.block_since >= BLOCK_HOLD_SECONDS:
          self._print_block(index)
      self._output.tick(now)

  def finish(self, codes: Sequence[Optional[int]], failed: bool) -> None:
    """After the group ended: prints what its failure needs, drops the rest.

    Args:
      codes: every worker's exit code (0: it succeeded).
      failed: whether the group failed; then the noise of every worker is
        counted, else only that of workers that did not exit 0.
    """
    with self._output.lock:
      self._finished = True
      noise = 0
      for index, worker in enumerate(self._workers):
        worker_failed = codes[index] != 0
        noise, worker.noise = noise + (worker.noise if failed or worker_failed else 0), 0
        if worker.repeats and worker_failed:
          others = sorted({first for _, first in worker.repeats})
          self._output.log(
              f"worker {index}'s last {len(worker.repeats)} line(s) are the same as worker "
              f"{', '.join(map(str, others))}'s above; not printed again.")
          worker.repeats, worker.repeats_since = [], None
        else:
          self._release(index)
      while True:
        held = [(w.block_since, i) for i, w in enumerate(self._workers) if w.block is not None]
        if not held:
          break
        self._print_block(min(held)[1])
      self._after_the_failure()
      if noise:
        self._output.log(
            f"{noise} TensorFlow log line{'s' if noise > 1 else ''} held back; {_SHOW_THEM}")


class Pump(threading.Thread):
  """Copies one worker's output to its WorkerLines: whole lines, and the redraws (`\\r`) of the current one."""

  def __init__(self, stream, index: int, lines: WorkerLines):
    super().__init__(daemon=True)
    self._stream, self._index, self._lines = stream, index, lines

  def _add(self, text):
    bar, line = _overwritten(text)
    if bar:
      self._lines.partial(self._index, bar)
    self._lines.add(self._index, line)

  def run(self):
    read = getattr(self._stream, "read1", self._stream.read)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    current = ""
    while True:
      chunk = read(1 << 16)
      current += decoder.decode(chunk, final=not chunk)
      *complete, current = current.split("\n")
      for text in complete:
        self._add(text)
      redraw = current.rfind("\r")
      if redraw >= 0:  # what comes before a `\r` is drawn over
        current = current[redraw:]
        if len(current) > 1:
          self._lines.partial(self._index, current[1:])
      if not chunk:
        break
    if current:
      self._add(current)
    self._lines.closed(self._index)
    self._stream.close()
