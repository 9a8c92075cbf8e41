"""The local tier's settings as one value: how often (an interval or "auto"), its overhead budget, its directory."""

import dataclasses

from tfdp import errors
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.local import tier as tier_lib

DEFAULT_OVERHEAD = policy.DEFAULT_OVERHEAD


@dataclasses.dataclass(frozen=True)
class LocalOptions:
  """What the local tier is asked to do, passed as one value from the callback or the manager to the tier.

  As Orbax's `LocalCheckpointOptions` beside its `PersistentCheckpointOptions`.
  The values are checked where the tier is made (`tier()`), so a bad one
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

  def tier(self, layout: layout_lib.Layout, me, timeout: float) -> "tier_lib.LocalTier | None":
    """The local tier of the persistent `layout` for worker `me`, or None when these options ask for none.

    Args:
      layout: the persistent directory's layout.
      me: this worker.
      timeout: seconds to wait for peers.

    Raises:
      ConfigError: a bad cadence or overhead, or several workers without a
        strategy (they agree on the newest state through its collectives).
    """
    options = self.checked()
    if not options.wanted:
      return None
    if me.count > 1 and me.strategy is None:
      raise errors.ConfigError(
          "The local checkpoint tier needs a MultiWorkerMirroredStrategy with "
          f"{me.count} workers: the workers agree on the newest state and "
          "recover lost copies through its collectives. Build the manager under "
          "strategy.scope() or pass strategy=.")
    return tier_lib.LocalTier(layout.local(options.directory, me.index), me, options.every_steps,
                              timeout, options.overhead)


def field_property(name: str, doc: str = "") -> property:
  """A property of an owner's `local_options.<name>`, settable as a plain attribute was (a new value)."""
  return property(lambda self: getattr(self.local_options, name),
                  lambda self, value: setattr(self, "local_options", dataclasses.replace(
                      self.local_options, **{name: value})), doc=doc)
