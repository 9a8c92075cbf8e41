"""Which local copies a worker keeps: the newest step complete on every worker, and what is newer (pure)."""

import threading
import time

# A worker keeps its newest LOCAL_KEEP copies, the newest complete step and
# every newer one, at most MAX_KEEP in all (its neighbour's per-worker
# states alike). A restore's agreement offers up to MAX_KEEP of each.
LOCAL_KEEP = 2
MAX_KEEP = 4
_POLL_S = 0.5  # How often a wait looks at its stop().


class Generations:
  """The newest step complete everywhere, from the workers' reports, and what that lets go.

  Worker w's part of step s is done once its own copy of s is committed
  and its per-worker state of s is kept by its neighbour (the neighbour
  acknowledged it, or there is none to keep). A step is complete when
  every worker's part is done: then any one worker can lose its host and
  the others still hold all it needs. Until a newer step is complete, the
  complete one stays, whatever the steps saved since.

  A step is dead when it can never be complete: a worker reported a newer
  step and not it (a worker's writer saves in order, and its reports to a
  worker go in order over one connection), or this worker's own part of it
  failed (`void`). A dead step never becomes the floor here.

  Thread-safe: the writer thread and the side channel's threads report.

  Args:
    num_workers: the job's workers.
    keep: the newest copies kept anyway (a copy damaged later has a previous one).
    most: the most copies kept (the newest complete step is never let go).
  """

  def __init__(self, num_workers: int, keep: int = LOCAL_KEEP, most: int = MAX_KEEP):
    self.num_workers, self.keep, self.most = num_workers, keep, most
    self._lock = threading.Condition()
    self._done = {}  # step -> workers whose part is done
    self._last = {}  # worker -> the newest step it reported done
    self._void = set()  # Dead steps this worker let go of, or whose own part failed.
    self.floor = None  # The newest complete step (or the step restored).

  def done(self, worker: int, step: int) -> None:
    """Worker `worker`'s part of `step` is done."""
    with self._lock:
      self._last[worker] = max(step, self._last.get(worker, step))
      self._lock.notify_all()
      if (self.floor is not None and step <= self.floor) or step in self._void:
        return
      workers = self._done.setdefault(step, set())
      workers.add(worker)
      if len(workers) >= self.num_workers:
        self.floor = step
        self._done = {s: w for s, w in self._done.items() if s > step}
        self._lock.notify_all()

  def void(self, step: int) -> None:
    """This worker's own part of `step` failed (its neighbour did not keep its state): it is dead."""
    with self._lock:
      self._void.add(step)
      self._lock.notify_all()

  def _dead(self, step: int) -> bool:
    if self.floor is not None and step <= self.floor:
      return False
    done = self._done.get(step, ())
    return step in self._void or any(last > step and w not in done
                                     for w, last in self._last.items())

  def wait_free(self, older: int, newest: int, timeout: float, stop) -> int | None:
    """Waits until one of the two steps a worker holds may be let go; returns it (None: not by then).

    `older` once a newer step is complete (it can then never become the
    floor again: the floor only moves on, but at a restore); else `newest`
    once it is dead (it can never become the floor; it is then void here).
    Waits at most `timeout` seconds, and not after `stop()` is true (the
    side channel closed, a worker lost).
    """
    deadline = time.monotonic() + timeout
    with self._lock:
      while True:
        if self.floor is not None and self.floor > older:
          return older
        if self._dead(newest):
          self._void.add(newest)
          return newest
        left = deadline - time.monotonic()
        if left <= 0 or stop():
          return None
        self._lock.wait(min(left, _POLL_S))

  def restored(self, step: int | None) -> None:
    """A restore at `step` (None: a fresh start): what all workers now hold; earlier reports are void."""
    with self._lock:
      self.floor = step
      self._done, self._last, self._void = {}, {}, set()
      self._lock.notify_all()

  def doomed(self, steps) -> list[int]:
    """Of the steps held (own copies, or a neighbour's states), those to delete, oldest first."""
    steps = sorted(set(steps))
    with self._lock:
      floor = self.floor
    kept = set(steps[-self.keep:]) if self.keep else set()
    if floor is None:
      kept |= set(steps[-self.most:])
    else:
      kept |= {s for s in steps if s >= floor}
    # Too many pending (a neighbour down, saves skipped): the oldest newer
    # than the floor go first; the floor stays.
    for s in sorted(kept):
      if len(kept) <= self.most:
        break
      if s != floor:
        kept.discard(s)
    return [s for s in steps if s not in kept]
