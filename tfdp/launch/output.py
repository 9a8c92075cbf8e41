"""The launcher's output: its own log lines and every worker's lines, prefixed, on one stream; known TF noise held back."""

import collections
import os
import queue
import re
import sys
import threading
import time
from typing import Mapping, NamedTuple, Optional, Sequence, TextIO

# Set to 1 (or pass --verbose_workers) to see every worker line as it comes.
ENV_SHOW_TF_LOGS = "TFDP_SHOW_TF_LOGS"

# A line that repeats one another worker printed is held this long at most,
# waiting to see whether its worker fails (then it is not printed again): long
# enough for a worker to exit after printing its error and for the launcher
# to stop the others, short enough not to delay a healthy worker's lines much.
REPEAT_HOLD_SECONDS = 3.0

# Held-back noise kept per worker; a worker that logs more keeps its last ones.
NOISE_KEPT_PER_WORKER = 1000

# Lines seen per attempt, to recognise a repeat; older ones are forgotten.
_SEEN_KEPT = 4096

# absl's prefix, as TF's C++ writes it (I0000 00:00:1796133538.349871   25316 f.cc:31])
# and as Python's absl writes it (W1201 14:02:15.351870 140258832587648 f.py:234]).
_ABSL = r"{levels}\d{{4}} [\d:.]+ +\d+ "


class Noise(NamedTuple):
  """A known kind of TF/gRPC log line that says nothing when the job succeeds.

  `line` must match the whole line; `continued` matches the lines that
  continue such a record (TF writes some records over several lines), held
  only right after one.
  """
  name: str
  line: "re.Pattern[str]"
  continued: Optional["re.Pattern[str]"] = None


def _noise(name, line, continued=None):
  return Noise(name, re.compile(line), re.compile(continued) if continued else None)


# Every worker writes these on a healthy run; a failed worker's are printed.
# Each matches one exact message, except TF's C++ INFO lines, which never
# report an error.
NOISE = (
    # Printed by every TF process before TF_CPP_MIN_LOG_LEVEL is read.
    _noise("absl-preinit", r"WARNING: All log messages before absl::InitializeLog\(\) "
                           r"is called are written to STDERR"),
    # A machine without a CUDA driver: TF says so, then cuInit fails with
    # CUDA_ERROR_SHARED_OBJECT_INIT_FAILED (303, no libcuda). A driver that is
    # there but broken fails with another code, which is shown.
    _noise("no-cuda-driver", _ABSL.format(levels="I") + r"cudart_stub\.cc:\d+\] Could not "
           r"find cuda drivers on your machine, GPU will not be used\."),
    _noise("cuinit-no-driver", _ABSL.format(levels="E") + r"cuda_platform\.cc:\d+\] failed "
           r"call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR \(303\)"),
    # TF's C++ INFO lines (TF_CPP_MIN_LOG_LEVEL=0): CPU features, the gRPC
    # server, the coordination service connecting its tasks.
    _noise("tf-cpp-info", _ABSL.format(levels="I") + r"[\w.-]+\.(?:cc|h):\d+\] .*",
           continued=r"To enable the following instructions: [\w ,.]+ in other operations, "
                     r"rebuild TensorFlow with the appropriate compiler flags\."
                     r"|/job:\w+/replica:\d+/task:\d+"),
    # tf.data about Python generators, on every Keras fit of NumPy arrays.
    _noise("dataset-not-optimized", _ABSL.format(levels="W") + r"dataset\.cc:\d+\] Input of "
           r"GeneratorDatasetOp::Dataset will not be optimized because the dataset does not "
           r"implement the AsGraphDefInternal\(\) method needed to apply optimizations\."),
    # A peer that is gone at the end of a finished run: a worker whose chief
    # (the coordination service) has exited, or the chief after a worker
    # stopped sending heartbeats. Mid-run the same lines come with a failure.
    _noise("start-abort-unavailable", _ABSL.format(levels="E") + r"base_collective_executor"
           r"\.cc:\d+\] BaseCollectiveExecutor::StartAbort UNAVAILABLE: (?:Failed to send RPC "
           r"to coordination service\.|Error reported from /job:\S+: The following tasks are "
           r"unhealthy \(stopped sending heartbeats\):).*",
           continued=r"/job:\w+/replica:\d+/task:\d+"
                     r"|The tasks have crashed\. Check the task logs for an earlier error.*"
                     r"|Additional GRPC error information from remote target /job:\S+ while "
                     r"calling /tensorflow\.CoordinationService/\w+:"
                     r"|:UNKNOWN:Error received from peer .*"),
    # tf.train.Checkpoint, when a checkpoint holds more than what restored it
    # (e.g. optimizer slots when only weights are restored). What a restore
    # left unset ("An attribute in the restored object could not be found")
    # is not in the list.
    _noise("checkpoint-unused-values",
           r"(?:" + _ABSL.format(levels="W") + r"checkpoint\.py:\d+\] |WARNING:tensorflow:)"
           r"(?:Detecting that an object or model or tf\.train\.Checkpoint is being deleted "
           r"with unrestored values\..*"
           r"|Value in checkpoint could not be found in the restored object: \S+)"),
)


def show_tf_logs(env: Optional[Mapping[str, str]] = None) -> bool:
  """True when ENV_SHOW_TF_LOGS asks for every worker line (anything but unset, '', 0, false, no)."""
  value = (os.environ if env is None else env).get(ENV_SHOW_TF_LOGS, "")
  return value.strip().lower() not in ("", "0", "false", "no")


class Output:
  """The launcher's output stream, shared by its own log and the workers' prefixed lines.

  `later` may be called from a signal handler: it only queues the line
  (SimpleQueue.put is reentrant), and the main loop writes it with `flush`.
  A handler that wrote itself could interrupt a write to the same stream.
  """

  def __init__(self, stream: Optional[TextIO] = None):
    self.stream = stream or sys.stdout
    # Reentrant: WorkerLines decides and writes under it.
    self.lock = threading.RLock()
    self._later = queue.SimpleQueue()

  def write_line(self, line: str) -> None:
    with self.lock:
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


class _Worker:
  """What WorkerLines holds back of one worker."""

  def __init__(self):
    self.noise = collections.deque(maxlen=NOISE_KEPT_PER_WORKER)
    self.noise_dropped = 0
    self.last_noise = None      # the Noise of this worker's previous line, if it was one
    self.repeats = []           # (line, the worker it repeats)
    self.repeats_since = None   # monotonic time of the first held repeat


class WorkerLines:
  """The lines of one group of workers, on their way to an `Output`.

  Two kinds of line are held back instead of printed as they come:
  - known TF/gRPC noise (`NOISE`): printed when the worker or the group
    fails, dropped when it succeeds;
  - lines that repeat, word for word, a line another worker of the group
    printed (every worker of a job runs the same code, and fails with the
    same usage error or traceback): printed as soon as the worker prints a
    line of its own, or after REPEAT_HOLD_SECONDS, or when it exits 0; not
    printed again when it fails.

  Everything else is printed at once. With `show_all` nothing is held.
  """

  def __init__(self, output: Output, num_workers: int, show_all: bool = False):
    self._output = output
    self._show_all = show_all
    self._workers = [_Worker() for _ in range(num_workers)]
    # hash(line) -> the first worker that printed it. Hashes, not lines: a Keras
    # progress bar is one line per epoch of every update, which can be 100s of KB.
    self._seen = collections.OrderedDict()
    self._finished = False

  @staticmethod
  def _prefix(index):
    return f"[worker {index}] "

  def add(self, index: int, text: str) -> None:
    """Takes one line (no newline) of worker `index`; called by its Pump."""
    with self._output.lock:
      if self._show_all or self._finished:
        self._output.write_line(self._prefix(index) + text)
        return
      worker = self._workers[index]
      kind = self._noise_kind(worker.last_noise, text)
      worker.last_noise = kind
      if kind is not None:
        if len(worker.noise) == worker.noise.maxlen:
          worker.noise_dropped += 1
        worker.noise.append(text)
        return
      key = hash(text)
      first = self._seen.get(key)
      if first is not None and first != index:
        self._seen.move_to_end(key)
        if not worker.repeats:
          worker.repeats_since = time.monotonic()
        worker.repeats.append((text, first))
        return
      self._release(index)
      self._output.write_line(self._prefix(index) + text)
      self._seen[key] = index if first is None else first
      if len(self._seen) > _SEEN_KEPT:
        self._seen.popitem(last=False)

  @staticmethod
  def _noise_kind(previous: Optional[Noise], text: str) -> Optional[Noise]:
    if previous is not None and previous.continued and previous.continued.fullmatch(text):
      return previous
    for noise in NOISE:
      if noise.line.fullmatch(text):
        return noise
    return None

  def _release(self, index):
    worker = self._workers[index]
    for text, _ in worker.repeats:
      self._output.write_line(self._prefix(index) + text)
    worker.repeats, worker.repeats_since = [], None

  def tick(self, now: Optional[float] = None) -> None:
    """Prints repeats held longer than REPEAT_HOLD_SECONDS; called by the watch loop."""
    now = time.monotonic() if now is None else now
    with self._output.lock:
      for index, worker in enumerate(self._workers):
        if worker.repeats and now - worker.repeats_since >= REPEAT_HOLD_SECONDS:
          self._release(index)

  def finish(self, codes: Sequence[Optional[int]], failed: bool) -> None:
    """After the group ended: prints what its failure needs, drops the rest.

    Args:
      codes: every worker's exit code (0: it succeeded).
      failed: whether the group failed; then every worker's noise is printed,
        else only that of workers that did not exit 0.
    """
    with self._output.lock:
      self._finished = True
      for index, worker in enumerate(self._workers):
        worker_failed = codes[index] != 0
        if worker.noise and (failed or worker_failed):
          dropped = (f" (and {worker.noise_dropped} earlier ones not kept)"
                     if worker.noise_dropped else "")
          self._output.log(
              f"worker {index}'s {len(worker.noise)} TF log line(s) held back while it "
              f"ran{dropped} ({ENV_SHOW_TF_LOGS}=1 or --verbose_workers shows them as they come):")
          for text in worker.noise:
            self._output.write_line(self._prefix(index) + text)
        worker.noise.clear()
        if worker.repeats and worker_failed:
          others = sorted({first for _, first in worker.repeats})
          self._output.log(
              f"worker {index}'s last {len(worker.repeats)} line(s) are the same as worker "
              f"{', '.join(map(str, others))}'s above; not printed again.")
          worker.repeats, worker.repeats_since = [], None
        else:
          self._release(index)


class Pump(threading.Thread):
  """Copies one worker's output, line by line, to its WorkerLines."""

  def __init__(self, stream, index: int, lines: WorkerLines):
    super().__init__(daemon=True)
    self._stream, self._index, self._lines = stream, index, lines

  def run(self):
    for raw in iter(self._stream.readline, b""):
      self._lines.add(self._index, raw.decode("utf-8", errors="replace").rstrip("\n"))
    self._stream.close()
