"""When to save: small, pure save-decision policies (no I/O), combined by AnyOf."""

import dataclasses
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
