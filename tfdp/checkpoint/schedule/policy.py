"""When to act at a step (save, save locally, evaluate, summarize): small pure policies, combined by AnyOf, asked through a Cadence.

The one concept of "is a save due now": `Cadence` (a policy and the previous
decision point) and its variants, `EpochEndCadence` (a backup's: saves due on
an epoch's last batch wait for its end) and `LocalCadence` (the local tier's:
every N steps, or "auto", measured and agreed by the workers).
"""

import collections
import dataclasses
import math
import time
from typing import Protocol, Sequence

from absl import logging

from tfdp import errors
from tfdp.distribute import cluster

# With "auto": how often (in steps) the workers measure and agree on the interval again.
AGREE_EVERY_STEPS = 25
# With "auto": the share of the training time local saves may cost (their
# blocked time and their writer's CPU), unless asked otherwise.
DEFAULT_OVERHEAD = 0.02


@dataclasses.dataclass(frozen=True)
class SaveContext:
  """What a policy sees when asked whether to save now.

  Attributes:
    step: the global step now.
    previous_step: the step at the previous decision point (None at the
      first), so a policy can see a multiple being crossed when the step moves
      by more than one (`steps_per_execution`).
    last_saved_step: the step of the newest checkpoint saved or restored.
    epoch_end: the decision is made at the end of an epoch.
    train_end: the decision is made at the end of training.
    preempted: the job is being preempted.
  """
  step: int
  previous_step: int | None = None
  last_saved_step: int | None = None
  epoch_end: bool = False
  train_end: bool = False
  preempted: bool = False


class SaveDecisionPolicy(Protocol):
  def should_save(self, ctx: SaveContext) -> bool:
    ...


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
  """Saves when the global step reaches or crosses a multiple of `n`."""
  n: int

  def __post_init__(self):
    if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
      raise errors.ConfigError(f"Save every N steps needs an int N >= 1, got {self.n!r}.")

  def should_save(self, ctx: SaveContext) -> bool:
    if ctx.previous_step is None:
      return ctx.step % self.n == 0
    return ctx.step // self.n > ctx.previous_step // self.n


class EveryAutoSteps:
  """Saves when the step reaches or crosses a multiple of `interval`, which follows an overhead budget.

  `interval_for` gives the smallest interval whose saves cost at most
  `budget` of the training time; the owner measures and sets `interval`
  (the same on every worker).
  """

  def __init__(self, budget: float, interval: int = 1):
    if not 0 < budget < 1:
      raise errors.ConfigError(
          f"checkpoint_overhead={budget!r}: pass a fraction of the step time, e.g. 0.02.")
    self.budget = budget
    self.interval = interval

  def should_save(self, ctx: SaveContext) -> bool:
    return EveryNSteps(self.interval).should_save(ctx)

  def interval_for(self, save_seconds: float, step_seconds: float,
                   most: int = 10_000) -> int:
    """Steps between saves so that `save_seconds` per save is `budget` of the steps' time."""
    if step_seconds <= 0:
      return 1
    return max(1, min(most, math.ceil(save_seconds / (self.budget * step_seconds))))


def every_steps(value) -> int | str | None:
  """A `local_checkpoint_every_steps` value checked: an int >= 1, "auto", or None (0, "": None).

  Raises:
    ConfigError: anything else.
  """
  if value in (None, 0, ""):
    return None
  if value == "auto":
    return "auto"
  if isinstance(value, str) and value.isdigit():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise errors.ConfigError(
        f"local_checkpoint_every_steps={value!r}: pass a positive number of steps or 'auto'.")
  return value


@dataclasses.dataclass(frozen=True)
class AtStep:
  """Saves when the global step reaches or crosses `n` (e.g. the last step of training)."""
  n: int

  def should_save(self, ctx: SaveContext) -> bool:
    return ctx.step >= self.n and (ctx.previous_step is None or ctx.previous_step < self.n)


@dataclasses.dataclass(frozen=True)
class Always:
  """Saves whenever asked (an explicit save; still never twice at one step)."""

  def should_save(self, ctx: SaveContext) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class MinInterval:
  """`tf.train.CheckpointManager`'s `checkpoint_interval`: at least `n` steps since the last save."""
  n: int

  def should_save(self, ctx: SaveContext) -> bool:
    return ctx.last_saved_step is None or ctx.step >= ctx.last_saved_step + self.n


@dataclasses.dataclass(frozen=True)
class EveryEpoch:
  """Saves at the end of every epoch."""

  def should_save(self, ctx: SaveContext) -> bool:
    return ctx.epoch_end


@dataclasses.dataclass(frozen=True)
class AtTrainEnd:
  """Saves once training ends."""

  def should_save(self, ctx: SaveContext) -> bool:
    return ctx.train_end


@dataclasses.dataclass(frozen=True)
class OnPreemption:
  """Saves when the job is preempted."""

  def should_save(self, ctx: SaveContext) -> bool:
    return ctx.preempted


@dataclasses.dataclass(frozen=True)
class AnyOf:
  """Saves when any policy says so, never twice at one step."""
  policies: Sequence[SaveDecisionPolicy]

  def should_save(self, ctx: SaveContext) -> bool:
    if ctx.last_saved_step is not None and ctx.step == ctx.last_saved_step:
      return False
    return any(p.should_save(ctx) for p in self.policies)


def from_save_freq(save_freq) -> AnyOf:
  """Keras's `save_freq` ("epoch" or an int N of steps) as a policy.

  Saves also when training ends and on preemption; an int counts global
  steps, so it survives resumes (Keras counts batches since `fit` began).

  Raises:
    ValueError (ConfigError): `save_freq` is neither.
  """
  if save_freq == "epoch":
    first = EveryEpoch()
  elif isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
    first = EveryNSteps(save_freq)
  else:
    raise errors.ConfigError(
        f"Unrecognized save_freq: {save_freq!r}; pass 'epoch' or a positive int of steps.")
  return AnyOf((first, OnPreemption()))


class Cadence:
  """Whether to act at a step: a decision policy and the step of the previous decision point.

  The one place that turns "every N steps", "every epoch", "at the end",
  "on preemption" into yes or no at a step. Persistent and local saves, a
  manager's `save()` with a step counter, evaluation and TensorBoard
  summaries each ask their own. A step that moves by more than one
  (`steps_per_execution > 1`) still hits every multiple it crosses, and
  nothing happens twice at one step (with `last_saved_step`).

  Args:
    *policies: what makes it due (any of them); none: never due.
  """

  def __init__(self, *policies: SaveDecisionPolicy):
    self.decision = AnyOf(tuple(policies))
    self.previous = None

  def start(self, step: int | None) -> None:
    """The step training (re)starts at: the next decision counts crossings from it."""
    self.previous = step

  def due(self, step: int, *, last_saved_step: int | None = None, advance: bool = True,
          **when) -> bool:
    """Whether to act at `step`.

    Args:
      step: the global step now.
      last_saved_step: the step of the newest save, so none is made twice.
      advance: this is the step's decision point (the end of a batch): the
        next call counts crossings from `step`. Epoch ends, the end of
        training and preemption ask without advancing.
      **when: `epoch_end`, `train_end`, `preempted` (see SaveContext).
    """
    ctx = SaveContext(step=step, previous_step=self.previous,
                      last_saved_step=last_saved_step, **when)
    if advance:
      self.previous = step
    return self.decision.should_save(ctx)


class EpochEndCadence(Cadence):
  """A backup's `Cadence` whose saves due on an epoch's last batch wait for that epoch's end.

  A backup taken after an epoch's last step but before its end holds none of
  what the end does (validation, the other callbacks' `on_epoch_end`: a CSV
  row, EarlyStopping's count): a resume from it must run that end again.
  Taken at the end instead (the same global step, after every other
  callback's `on_epoch_end`), it resumes at the next epoch. An epoch's last
  batch is known when the epoch's number of steps is (`last_batch(step)`).

  Args:
    *policies: as `Cadence`'s.
    last_batch: `fn(step) -> bool`: whether `step` ends the current epoch.
  """

  def __init__(self, *policies: SaveDecisionPolicy, last_batch):
    super().__init__(*policies)
    self._last_batch = last_batch
    self._held = None  # The step of a save held for the epoch's end.

  def start(self, step: int | None) -> None:
    super().start(step)
    self._held = None

  def due(self, step: int, *, last_saved_step: int | None = None, advance: bool = True,
          **when) -> bool:
    if advance and self._last_batch(step):
      if super().due(step, last_saved_step=last_saved_step, advance=True, **when):
        self._held = step
      return False
    if when.get("epoch_end") and self._held is not None:
      held, self._held = self._held, None
      if held == step and last_saved_step != step:
        return True
    return super().due(step, last_saved_step=last_saved_step, advance=advance, **when)


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


class LocalCadence(Cadence):
  """The local tier's `Cadence`: whether the training loop saves locally after a step (every worker asks at every step).

  Args:
    every_steps: an int, "auto", or None (when the caller says).
    overhead: with "auto", the share of the training time saves may cost.
    me: this worker (`tfdp.distribute.cluster.Worker`, its strategy for the agreement).
    costs: `fn()` -> (blocked, writer CPU) seconds of the latest saves.
  """

  def __init__(self, every_steps, overhead: float, me, costs):
    self.every_steps = every_steps
    self.me = me
    self._costs = costs
    self._auto = EveryAutoSteps(overhead) if every_steps == "auto" else None
    rule = self._auto or (EveryNSteps(every_steps) if every_steps else None)
    super().__init__(*((rule,) if rule else ()))
    self._window = Cadence(EveryNSteps(AGREE_EVERY_STEPS))
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

  def due(self, step: int, **kwargs) -> bool:
    """Whether to save after `step` (`kwargs` as `Cadence.due`'s).

    With "auto", every AGREE_EVERY_STEPS steps the workers measure what a
    save cost (its blocked time plus its writer's CPU, the median of the
    last ones) against the time a step took in the window, and agree (one
    small all-reduce, the largest proposal) on the smallest interval within
    the overhead budget; before the first window, every step.
    """
    if self._auto is not None:
      self._retune(step, self._costs)
    return super().due(step, **kwargs)

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
