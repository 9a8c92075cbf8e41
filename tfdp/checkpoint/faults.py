"""The local tier's last fault hooks (slot fill, peer transfer), until they too are wrapped by tests (then removed).

The persistent save's phases are tests/save_faults.py's.
"""

from collections.abc import Callable

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
