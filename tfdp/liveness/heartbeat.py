"""Liveness: per-batch heartbeats for tfdp-launch, and a prompt exit that names a lost peer."""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
from typing import Any, Iterable

from absl import logging
import keras

from tfdp.distribute import cluster
from tfdp.distribute import environment
from tfdp.liveness import stall

# The file a worker's heartbeats go to; tfdp-launch sets it for every worker.
ENV_HEARTBEAT_FILE = "TFDP_HEARTBEAT_FILE"

# Exit code of a worker whose peer disappeared (sysexits' EX_UNAVAILABLE).
# tfdp-launch treats it as a consequence of another worker's failure.
EXIT_PEER_LOST = 69

# The peer watchdog checks every peer every PEER_CHECK_INTERVAL seconds; a
# check gives up after PEER_CHECK_TIMEOUT seconds and a peer is lost after
# PEER_CHECK_ATTEMPTS failed checks in a row, 1 s apart.
PEER_CHECK_INTERVAL = 2.0
PEER_CHECK_TIMEOUT = 5.0
PEER_CHECK_ATTEMPTS = 3
# TF's peer check holds the GIL until it returns, which freezes every
# Python thread of the process (the preemption grace watchdog included)
# while a peer is hung. A check is made of probes of at most this long.
PEER_PROBE_SECONDS = 0.5

# The documented bound: a worker whose peer process dies or becomes
# unreachable during training exits with EXIT_PEER_LOST within this many
# seconds. It covers the slower of the two detectors: TF's coordination
# service (tfdp.distribute.strategy.DEFAULT_PEER_TIMEOUT_SECONDS = 10 s of missed
# heartbeats, then the collectives of every survivor are aborted) and the
# watchdog (at most 2 + 3 x 5 + 2 x 1 = 19 s; a peer whose process died on a
# live host fails a check at once, ~4 s), plus a margin for a loaded host.
PEER_LOSS_BOUND_SECONDS = 30.0

_TASK = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


def beat(path: str, step: int) -> None:
  """Writes `step` and the time to the heartbeat file `path` (its mtime is the beat)."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"{step} {time.time():.3f}\n")


class Heartbeat(keras.callbacks.Callback):
  """Tells the launcher that training makes progress: one beat per batch.

  A beat rewrites a tiny file (the global step and the time); `tfdp-launch
  --hang_timeout=S` counts a worker whose file did not change for S seconds
  as hung and restarts the group. Does nothing when no file is given and
  TFDP_HEARTBEAT_FILE is unset.

  Args:
    path: the heartbeat file (default: $TFDP_HEARTBEAT_FILE).
    min_interval: seconds between two writes at least, so tiny steps cost
      no more than a few writes a second.
  """

  def __init__(self, path: str | None = None, min_interval: float = 0.25,
               watch_peers: bool = True):
    super().__init__()
    self.path = path or os.environ.get(ENV_HEARTBEAT_FILE) or None
    self.min_interval = min_interval
    self.watch_peers = watch_peers
    self._last = 0.0
    self._watchdog = None

  def on_train_begin(self, logs=None):
    if self.watch_peers and self._watchdog is None:
      self._watchdog = PeerWatchdog.for_strategy(self.model.distribute_strategy)
      if self._watchdog is not None:
        self._watchdog.start()

  def _beat(self, force=False):
    if not self.path:
      return
    now = time.monotonic()
    if not force and now - self._last < self.min_interval:
      return
    self._last = now
    try:
      step = int(self.model.optimizer.iterations.numpy())
    except (AttributeError, TypeError, ValueError):
      step = -1
    try:
      beat(self.path, step)
    except OSError as e:  # A full disk must not stop training.
      logging.warning("tfdp: cannot write heartbeat %s: %s", self.path, e)

  def on_train_batch_end(self, batch, logs=None):
    self._beat()

  def on_test_batch_end(self, batch, logs=None):
    self._beat()

  def on_epoch_end(self, epoch, logs=None):
    self._beat(force=True)

  def on_train_end(self, logs=None):
    self._beat(force=True)
    # Peers may finish and exit before us from here on.
    if self._watchdog is not None:
      self._watchdog.stop()
      self._watchdog = None


class PeerWatchdog:
  """A thread that exits the process, naming the peer, when a peer of the cluster is gone.

  TensorFlow aborts pending collectives when its coordination service misses
  a peer's heartbeats, but a worker busy outside a collective (writing or
  waiting for checkpoint shards, reading data) would not notice. Every
  `interval` seconds this checks each peer with
  `check_collective_ops_peer_health` (what MultiWorkerMirroredStrategy's own
  health-check thread does when the coordination service is off); after
  `attempts` failures in a row it calls `exit_peer_lost`. Run it only while
  every peer is expected to be alive (tfdp's Heartbeat: during `fit`).
  """

  def __init__(self, peers: Iterable[tuple[str, int]], *,
               interval: float = PEER_CHECK_INTERVAL,
               timeout: float = PEER_CHECK_TIMEOUT,
               attempts: int = PEER_CHECK_ATTEMPTS):
    self.peers = list(peers)
    self.interval, self.timeout, self.attempts = interval, timeout, attempts
    self._stop = threading.Event()
    self._thread = None

  @classmethod
  def for_strategy(cls, strategy: Any, **kw) -> PeerWatchdog | None:
    """A watchdog of the other tasks of a multi-worker `strategy`, or None."""
    peers = cluster.peers(strategy)
    return cls(peers, **kw) if peers else None

  def start(self) -> None:
    # Peers that finish (or save after a preemption) exit at slightly
    # different times; a process on its way out watches no more.
    atexit.register(self.stop)
    self._thread = threading.Thread(target=self._run, name="tfdp-peer-watchdog",
                                    daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    atexit.unregister(self.stop)

  def _run(self):
    # pylint: disable=g-import-not-at-top
    import tensorflow as tf
    from tensorflow.python.eager import context
    # pylint: enable=g-import-not-at-top
    down = (tf.errors.UnavailableError, tf.errors.FailedPreconditionError,
            tf.errors.DeadlineExceededError)
    while not self._stop.wait(self.interval):
      for job, index in self.peers:
        task = f"/job:{job}/replica:0/task:{index}"
        for attempt in range(1, self.attempts + 1):
          try:
            check_peer(context.context(), task, self.timeout)
            break
          except down as e:
            if self._stop.is_set():
              return
            if attempt == self.attempts:
              exit_peer_lost(e, f"{task} failed {attempt} health checks in a row")
            logging.warning("tfdp: %s seems down (%d/%d): %s", task, attempt,
                            self.attempts, " ".join(str(e).split())[:200])
            if self._stop.wait(1.0):
              return
          except Exception as e:  # pylint: disable=broad-except
            logging.warning("tfdp: peer check of %s failed: %s", task, e)
            break


def check_peer(ctx: Any, task: str, timeout: float,
               probe: float = PEER_PROBE_SECONDS) -> None:
  """TF's health check of `task` within `timeout` s, in probes of at most `probe` s.

  `check_collective_ops_peer_health` holds the GIL for as long as it waits,
  so one long call stops every other Python thread for up to `timeout`;
  between probes they run. A peer that answers any probe is healthy.

  Raises:
    what the last probe raised: DeadlineExceededError when no probe was
    answered within `timeout`; UnavailableError or FailedPreconditionError
    at once (the peer is gone or was restarted).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout
  while True:
    left = deadline - time.monotonic()
    try:
      ctx.check_collective_ops_peer_health(
          task, timeout_in_ms=max(1, int(min(left, probe) * 1000)))
      return
    except tf.errors.DeadlineExceededError:
      if time.monotonic() >= deadline - 0.001:
        raise


def lost_peers(message: str, tf_config: dict | None = None) -> list[str]:
  """The peers an error message of TensorFlow names, as 'worker 1 (host:port)' strings.

  Args:
    message: the text of a collective or coordination-service error.
    tf_config: parsed TF_CONFIG (default: the environment's); this task is
      left out and addresses are added.
  """
  if tf_config is None:
    tf_config = environment.tf_config_or_empty()
  own = environment.own_task(tf_config)
  jobs = tf_config.get("cluster") or {}
  peers = []
  for job, index in _TASK.findall(message or ""):
    index = int(index)
    if (job, index) == own:
      continue
    addresses = jobs.get(job) or []
    name = f"{job} {index}"
    if index < len(addresses):
      name += f" ({addresses[index]})"
    if name not in peers:
      peers.append(name)
  return peers


def is_peer_loss(error: BaseException) -> bool:
  """True for the errors TensorFlow raises when a peer of a collective is gone or hung."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                            tf.errors.AbortedError, tf.errors.CancelledError)):
    return False
  text = str(error)
  return bool(lost_peers(text)) or any(
      k in text for k in ("Collective", "collective", "heartbeat", "coordination"))


def _leader(tf_config):
  """The coordination service's leader: the chief, else worker 0."""
  job, index = environment.chief_task(tf_config)
  if environment.own_task(tf_config) == (job, index):
    return None
  addresses = ((tf_config or {}).get("cluster") or {}).get(job) or []
  return f"{job} {index}" + (f" ({addresses[index]})" if len(addresses) > index else "")


def describe_peer_loss(error: Any, context: str | None = None) -> str:
  """One line for the log: which peer was lost and what TensorFlow said."""
  text = " ".join(str(getattr(error, "message", error)).split())
  peers = lost_peers(context or text) or lost_peers(text)
  if not peers and "CoordinationService" in text:
    # This worker's heartbeats to the coordination service go unanswered.
    leader = _leader(environment.tf_config_or_empty())
    peers = [f"{leader}, the coordination service leader"] if leader else []
  who = ", ".join(peers) if peers else "an unnamed peer"
  # The cause, without the graph's Python traceback TF puts before it.
  for marker in ("aborted by: ", "unhealthy", "Connection", "timed out"):
    if marker in text:
      text = text[text.index(marker):]
      break
  detail = (context + ": " if context else "") + text[:240]
  if not context and "timed out" in text:
    return f"a collective timed out (--collective_timeout); lost peer {who}: {detail}"
  return f"lost peer {who}: {detail}"


def exit_peer_lost(error: Any, context: str | None = None) -> None:
  """Logs which peer was lost and ends the process at once with EXIT_PEER_LOST.

  `os._exit` skips interpreter teardown, where TensorFlow's coordination
  agent would otherwise wait for the lost peer's shutdown barrier; the
  group cannot save any more anyway (saves are collective).
  """
  stall.exit_process(f"tfdp: {describe_peer_loss(error, context)}", EXIT_PEER_LOST)
