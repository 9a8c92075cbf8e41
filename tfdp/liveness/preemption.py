"""Preemption: on SIGTERM/SIGINT to any worker, all workers agree on a step, save and exit."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable

from absl import logging
import keras

from tfdp.distribute import cluster

# Exit code of a worker that was preempted and saved a checkpoint at the step
# all workers agreed on: relaunch the same command to resume exactly. It is
# sysexits' EX_TEMPFAIL ("temporary failure, retry later"), distinct from 143
# (128 + SIGTERM) so a supervisor can tell a clean preemption from a kill.
EXIT_PREEMPTED = 75

# Exit code when the grace period ran out before the preemption checkpoint
# was committed (e.g. a peer hung or died): the same as a death by SIGTERM.
# The relaunched job resumes from the last periodic checkpoint.
EXIT_GRACE_EXPIRED = 128 + signal.SIGTERM

# Kubernetes gives a pod 30 s between SIGTERM and SIGKILL by default; leave
# some of it for the process to exit.
DEFAULT_GRACE_SECONDS = 25.0

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
  """Raised after a preemption checkpoint is committed; exits with EXIT_PREEMPTED.

  A `SystemExit`, so that an uncaught one ends the program with the
  documented exit code and no traceback, and `except Exception` in user code
  does not swallow it.

  Attributes:
    step: the global step all workers stopped and saved at.
    checkpoint: the checkpoint's prefix (None if nothing was saved).
  """

  def __init__(self, step: int, checkpoint: str | None = None):
    super().__init__(EXIT_PREEMPTED)
    self.step = step
    self.checkpoint = checkpoint

  def __str__(self) -> str:
    return f"preempted at step {self.step}; checkpoint: {self.checkpoint}"


class SignalHandler:
  """Turns SIGTERM/SIGINT into a flag and starts the grace-period clock.

  The first signal sets `requested`; the training loop polls it between
  steps. A watchdog thread, woken by the signal itself (through
  `signal.set_wakeup_fd`, so even while the main thread is blocked inside a
  TensorFlow op or a collective whose peer is gone), hard-exits the process
  with EXIT_GRACE_EXPIRED if `finished()` is not called within
  `grace_seconds`. Later signals are ignored: `tfdp-launch` forwards one
  signal and may send SIGTERM again while a worker is saving.

  Install it in the main thread (Python's rule for signal handlers); from
  another thread `install` only logs a warning.

  Args:
    grace_seconds: time from the first signal to a forced exit; None or
      <= 0 disables the watchdog.
    signals: the signals that request preemption.
  """

  def __init__(self, grace_seconds: float | None = DEFAULT_GRACE_SECONDS,
               signals: Iterable[int] = SIGNALS):
    self.grace_seconds = grace_seconds
    self.signals = tuple(signals)
    self.signum = None
    self.received_at = None
    self._done = threading.Event()
    self._previous = {}
    self._previous_fd = None
    self._sockets = None
    self._thread = None

  @property
  def requested(self) -> bool:
    """True once any of the signals arrived."""
    return self.signum is not None

  def install(self) -> "SignalHandler":
    """Installs the handlers and the watchdog; returns self."""
    if self._previous:
      return self
    if threading.current_thread() is not threading.main_thread():
      logging.warning("tfdp: not in the main thread; SIGTERM/SIGINT will not "
                      "save a preemption checkpoint.")
      return self
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    self._sockets = (reader, writer)
    # A new flag, clock and event per installation: a signal seen by an
    # earlier one (an earlier `fit`) is not this one's.
    self.signum = None
    self.received_at = None
    self._done = threading.Event()
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._on_signal)
    self._previous_fd = signal.set_wakeup_fd(writer.fileno(),
                                             warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._watch, args=(reader, self._done),
                                    name="tfdp-preemption", daemon=True)
    self._thread.start()
    return self

  def uninstall(self) -> None:
    """Restores the previous handlers; the watchdog stops."""
    if not self._previous:
      return
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}
    signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
    self._done.set()
    for s in self._sockets:
      s.close()

  def finished(self) -> None:
    """Says the preemption checkpoint is committed: the watchdog stands down."""
    self._done.set()

  def __enter__(self):
    return self.install()

  def __exit__(self, *exc):
    self.uninstall()

  def _note(self, signum):
    if self.signum is None:
      self.signum = signum
      self.received_at = time.monotonic()

  def _on_signal(self, signum, _frame):
    self._note(signum)

  def _watch(self, reader, done):
    while True:
      try:
        data = reader.recv(64)
      except OSError:
        return
      if not data:
        return
      received = [b for b in data if b in [int(s) for s in self.signals]]
      if received:
        # The Python-level handler may not have run yet (main thread busy).
        self._note(received[0])
        break
    logging.warning("tfdp: received %s; saving at the next step all workers "
                    "agree on (grace period %s s).",
                    signal.Signals(self.signum).name, self.grace_seconds)
    if not self.grace_seconds or self.grace_seconds <= 0:
      return
    if not done.wait(self.grace_seconds):
      logging.error("tfdp: no preemption checkpoint within the grace period of "
                    "%s s; exiting with code %d.", self.grace_seconds,
                    EXIT_GRACE_EXPIRED)
      logging.flush()
      os._exit(EXIT_GRACE_EXPIRED)  # pylint: disable=protected-access


def any_worker(strategy: Any, flag: bool) -> bool:
  """True on every worker if `flag` is True on any worker.

  Under a multi-worker strategy this is one tiny all-reduce
  (`tfdp.distribute.cluster.agree`), so every worker must call it at the same point
  (the same step); elsewhere it is `flag`.
  """
  return cluster.agree(1.0 if flag else 0.0, "max", strategy) > 0


class PreemptionCallback(keras.callbacks.Callback):
  """Stops every worker at the same step after a preemption signal, saves, raises `Preempted`.

  After every `check_every_steps` global steps each worker contributes its
  signal flag to one all-reduce; the sum is the same on every worker, so
  all of them see the preemption at the same step. They call `save_fn(step)`
  (which must save on every worker, e.g. through `tfdp.CheckpointManager`,
  and return the prefix once committed) and raise `Preempted`, which ends
  `fit` and, uncaught, the process with EXIT_PREEMPTED.

  Args:
    save_fn: `fn(step) -> checkpoint prefix`, called on every worker.
    handler: a `SignalHandler`; by default one is installed for the length
      of `fit`.
    grace_seconds: grace period of the default handler.
    check_every_steps: agree every this many steps (each agreement is one
      all-gather of 8 bytes per replica).
  """

  def __init__(self, save_fn: Callable[[int], str | None], *,
               handler: SignalHandler | None = None,
               grace_seconds: float | None = DEFAULT_GRACE_SECONDS,
               check_every_steps: int = 1):
    super().__init__()
    if check_every_steps < 1:
      raise ValueError(f"check_every_steps must be >= 1, got {check_every_steps}.")
    self.save_fn = save_fn
    self.handler = handler
    self._own_handler = handler is None
    self.grace_seconds = grace_seconds
    self.check_every_steps = check_every_steps

  def on_train_begin(self, logs=None):
    if self.handler is None:
      self.handler = SignalHandler(self.grace_seconds)
    if self._own_handler:
      self.handler.install()

  def on_train_end(self, logs=None):
    if self._own_handler:
      self.handler.uninstall()

  def on_train_batch_end(self, batch, logs=None):
    step = int(self.model.optimizer.iterations.numpy())
    if step % self.check_every_steps:
      return
    if not any_worker(self.model.distribute_strategy, self.handler.requested):
      return
    logging.warning("tfdp: preemption: all workers stop at step %d and save.", step)
    path = self.save_fn(step)
    self.handler.finished()
    self.model.stop_training = True
    raise Preempted(step, path)
