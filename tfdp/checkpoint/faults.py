"""Named phases of a save where a test-installed hook may inject a fault (no-op otherwise)."""

from collections.abc import Callable

# The phases of a sharded save, in order.
PHASES = ("before_shard", "after_shard", "after_marker", "during_commit",
          "after_commit")

Hook = Callable[[str, int], None]
_hook: Hook | None = None


def install(hook: Hook | None) -> None:
  """Installs `hook(phase, worker)`, called as each save reaches a phase (None removes it)."""
  global _hook
  _hook = hook


def reached(phase: str, worker: int) -> None:
  """Called by the save path at `phase`; runs the installed hook, if any."""
  if _hook is not None:
    _hook(phase, worker)
