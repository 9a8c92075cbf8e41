"""How often the local tier saves: every N steps, or "auto": as often as an overhead budget allows, measured and agreed."""

import collections
import dataclasses
import time

from absl import logging

from tfdp.distribute import cluster
from tfdp.checkpoint import policy

# With "auto": how often (in steps) the workers measure and agree on the interval again.
AGREE_EVERY_STEPS = 25


@dataclasses.dataclass(frozen=True)
class Tuning:
  """One of "auto"'s measurements: the interval the workers agreed on, and what it came from."""
  step: int
  interval: int
  cost: float | None  # Seconds per save (blocked plus its writer's CPU; median), None: unmeasured.
  step_seconds: float
  budget: float  # The share of the training time saves may cost.
  worker: int | None = None  # Whose measurement chose it (of several workers).

  def describe(self) -> str:
    """The line the chief says when the interval is first chosen or changes."""
    on = "" if self.worker is None else f" on worker {self.worker}"
    return (f"local saves every {self.interval} step(s) (local_checkpoint_every_steps='auto': "
            f"a save costs {self.cost_text}{on}, blocked plus its writer's CPU; a step "
            f"{1e3 * self.step_seconds:.1f} ms; the budget is {100 * self.budget:.0f}% of "
            "the training time)")

  @property
  def cost_text(self) -> str:
    return "unknown" if self.cost is None else f"{1e3 * self.cost:.1f} ms"


class LocalCadence:
  """Whether the training loop saves locally after a step (every worker asks at every step).

  Args:
    every_steps: an int, "auto", or None (when the caller says).
    overhead: with "auto", the share of the training time saves may cost.
    me: this worker (`tfdp.distribute.cluster.Worker`, its strategy for the agreement).
  """

  def __init__(self, every_steps, overhead: float, me):
    self.every_steps = every_steps
    self.me = me
    self._auto = policy.EveryAutoSteps(overhead) if every_steps == "auto" else None
    rule = self._auto or (policy.EveryNSteps(every_steps) if every_steps else None)
    self._cadence = policy.Cadence(*((rule,) if rule else ()))
    self._window = policy.Cadence(policy.EveryNSteps(AGREE_EVERY_STEPS))
    self._window_start = None  # (time, step, blocked so far) where the window began.
    self.blocked_total = 0.0
    # The seconds the caller was blocked in the latest saves.
    self.blocked = collections.deque(maxlen=16)
    # With "auto": the latest measurement that chose a new interval (or the first).
    self.tuning: Tuning | None = None

  @property
  def interval(self) -> int | None:
    """The steps between local saves now (with "auto": the agreed one)."""
    return self._auto.interval if self._auto else self.every_steps

  def note_blocked(self, seconds: float) -> None:
    self.blocked_total += seconds
    self.blocked.append(seconds)

  def due(self, step: int, costs) -> bool:
    """Whether to save after `step`; `costs()` gives (blocked, writer CPU) seconds of the latest saves.

    With "auto", every AGREE_EVERY_STEPS steps the workers measure what a
    save cost (its blocked time plus its writer's CPU, the median of the
    last ones) against the time a step took in the window, and agree (one
    small all-reduce, the largest proposal) on the smallest interval within
    the overhead budget; before the first window, every step.
    """
    if self._auto is not None:
      self._retune(step, costs)
    return self._cadence.due(step)

  def _retune(self, step, costs):
    now = time.perf_counter()
    if self._window_start is None:
      self._window.start(step)
      self._window_start = (now, step, self.blocked_total)
      return
    if not self._window.due(step):
      return
    t0, s0, blocked0 = self._window_start
    self._window_start = (now, step, self.blocked_total)
    measured = sorted(b + w for b, w in costs())
    cost = measured[len(measured) // 2] if measured else None
    step_seconds = max(0.0, now - t0 - (self.blocked_total - blocked0)) / max(1, step - s0)
    proposal = (self._auto.interval if cost is None
                else self._auto.interval_for(cost, step_seconds))
    worker = None
    if self.me.count > 1:
      # The largest proposal wins; its worker's figures are the ones said,
      # so the line's numbers give its interval on every worker.
      rows = cluster.gather([proposal, -1.0 if cost is None else cost, step_seconds],
                            self.me.strategy)
      worker = max(range(len(rows)), key=lambda w: (rows[w][0], -w))
      proposal, cost, step_seconds = int(rows[worker][0]), rows[worker][1], rows[worker][2]
      cost = None if cost < 0 else float(cost)
    if self.tuning is None or proposal != self._auto.interval:
      self._auto.interval = proposal
      self.tuning = Tuning(step, proposal, cost, float(step_seconds), self._auto.budget, worker)
      if self.me.is_chief:
        logging.info("tfdp: %s.", self.tuning.describe())
