"""When to act at a step (save, save locally, evaluate, summarize): small pure policies, combined by AnyOf, asked through a Cadence."""

import dataclasses
import math
from typing import Protocol, Sequence

from tfdp import errors


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
