"""The local tier's settings as one value: how often (an interval or "auto"), its overhead budget, its directory."""

import dataclasses

from tfdp.checkpoint import policy

# With every_steps="auto": the share of the training time local saves may
# cost (their blocked time and their writer's CPU).
DEFAULT_OVERHEAD = 0.02


@dataclasses.dataclass(frozen=True)
class LocalOptions:
  """What the local tier is asked to do, passed as one value from the callback or the manager to the tier.

  As Orbax's `LocalCheckpointOptions` beside its `PersistentCheckpointOptions`.
  The values are checked where the tier is made (`tier.make`), so a bad one
  is refused when the manager is built, as before. Peer replication is not a
  setting: with several workers each one's per-worker state always goes to
  its neighbour (a resume on a replaced host needs it).

  Attributes:
    every_steps: how often the training loop saves locally: an int N
      (whenever the step reaches or crosses a multiple of N), "auto" (as
      often as `overhead` allows, measured and agreed), or None (only when
      the caller says, `save_local()`).
    overhead: with "auto", the share of the training time local saves may
      cost (blocked time plus their writer's CPU).
    directory: the local root (None: the default, under /dev/shm).
  """
  every_steps: int | str | None = None
  overhead: float = DEFAULT_OVERHEAD
  directory: str | None = None

  def checked(self) -> "LocalOptions":
    """The same options with `every_steps` checked and normalized (an int >= 1, "auto" or None).

    Raises:
      ConfigError: a bad `every_steps`.
    """
    return dataclasses.replace(self, every_steps=policy.every_steps(self.every_steps))

  @property
  def wanted(self) -> bool:
    """Whether a local tier is asked for at all (a directory, or a cadence)."""
    return self.directory is not None or bool(policy.every_steps(self.every_steps))
