"""A step stuck in a collective: its pending collectives aborted, one line naming the collective and the step, exit 70.

Under MultiWorkerMirroredStrategy a worker whose peer is alive but stuck (a
hung callback, a deadlock, workers that took different paths) waits in the
next collective forever. TensorFlow's own per-collective timeout
(`CommunicationOptions(timeout_seconds=...)`) is no cure at a useful length:
each collective it runs keeps a timer thread for the whole timeout, so 600 s
at ResNet-20's pace held over 10,000 threads (measured: the thread count of
a 2-worker job grew by ~120 a second) until thread creation failed.

So the deadline is kept here, in Python: `Deadline.watch` brackets one call
of a Keras train, test or predict function; a daemon thread checks the call
in progress once a second, and when it has run past the limit it aborts the
process's pending collectives (`context.abort_collective_ops`, what
MultiWorkerMirroredStrategy's own health check does). The call then raises
TensorFlow's error, which names the collective's node, and `exit_if_stalled`
turns it into one line and exit code EXIT_COLLECTIVE_TIMEOUT (tfdp-launch
restarts the group). A call stuck outside any collective is ended by the
thread itself, ABORT_GRACE_SECONDS later.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time

from absl import logging

# Exit code of a worker that waited in a collective past its timeout; equals
# tfdp.launch.EXIT_COLLECTIVE_TIMEOUT (a test checks).
EXIT_COLLECTIVE_TIMEOUT = 70
# After the abort, how long the stuck call has to raise before the thread exits itself.
ABORT_GRACE_SECONDS = 10.0
# The first call of a function also traces it and waits for every worker to
# start its first collectives: it gets this many timeouts.
FIRST_CALL_FACTOR = 2

_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_BUCKET = re.compile(r"tfdp_gradient_bucket_(\d+)_of_(\d+)")
_ABORT_MESSAGE = "tfdp: a collective waited past the collective timeout"


def describe(error, step: int | None, timeout: float | None, where: str = "step") -> str:
  """One line: which collective waited too long (from TF's error), and where."""
  text = str(getattr(error, "message", error)) if error is not None else ""
  nodes = _NODE.findall(text)
  node = nodes[-1] if nodes else None
  bucket = _BUCKET.search(node or "")
  if bucket:
    what = f"the gradient all-reduce of bucket {bucket.group(1)} of {bucket.group(2)}"
  elif node:
    what = f"collective {node}"
  else:
    what = "a collective"
  waited = f"more than {timeout:g} s" if timeout else "past its timeout"
  at = f" at {where} {step}" if step is not None else f" in {where}"
  return (f"{what} waited {waited}{at}: another worker is stuck or the workers took "
          "different paths (tfdp.configure_gradients(timeout_seconds=...) sets the timeout)")


def exit_process(line: str, code: int) -> None:
  """Logs `line` and ends the process at once with `code`.

  `os._exit` skips interpreter teardown, where TensorFlow's coordination
  agent would wait for a stuck or lost peer at its shutdown barrier.
  """
  logging.error("%s; exiting with code %d.", line, code)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _exit(line: str) -> None:
  exit_process(f"tfdp: {line}", EXIT_COLLECTIVE_TIMEOUT)


class Deadline:
  """The limit on one call at a time of this process's train/test/predict functions."""

  def __init__(self, check_every: float = 1.0):
    self._check_every = check_every
    self._lock = threading.Lock()
    self._call = None  # (started, limit, where) of the call in progress
    self._thread = None
    self.fired = None  # (limit, where) once it aborted a call

  @contextlib.contextmanager
  def watch(self, limit: float | None, where: str):
    """Brackets one call; `limit` None: no deadline."""
    if limit is None:
      yield
      return
    with self._lock:
      self._call = (time.monotonic(), float(limit), where)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name="tfdp-collective-deadline",
                                        daemon=True)
        self._thread.start()
    try:
      yield
    finally:
      with self._lock:
        self._call = None

  def _run(self):
    while True:
      time.sleep(self._check_every)
      with self._lock:
        call = self._call
      if call is None or self.fired is not None:
        continue
      started, limit, where = call
      if time.monotonic() - started <= limit:
        continue
      self.fired = (limit, where)
      from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      logging.warning("tfdp: %s has run %.0f s, past the collective timeout; aborting its "
                      "collectives.", where, time.monotonic() - started)
      context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, _ABORT_MESSAGE)
      time.sleep(ABORT_GRACE_SECONDS)
      with self._lock:
        still = self._call is call
      if still:  # stuck outside any collective TF could abort
        _exit(describe(None, None, limit, where))


DEADLINE = Deadline()


def exit_if_stalled(error: BaseException, step: int | None, where: str = "step") -> None:
  """After a call raised: when the deadline fired (or TF's own timeout did), one line and exit 70; else returns."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not isinstance(error, tf.errors.OpError):
    return
  text = str(error)
  tf_timeout = ("Collective has timed out" in text or "Collective ops timeout" in text)
  if DEADLINE.fired is None and not tf_timeout:
    return
  limit = DEADLINE.fired[0] if DEADLINE.fired is not None else None
  _exit(describe(error, step, limit, where))
