"""The fixes' registry: what a fix is, how one is registered, how one patches an upstream attribute."""

import dataclasses
import inspect
from typing import Callable

# Set on every replacement a fix installs: the fix's name.
MARK = "__tfdp_compat_fix__"


@dataclasses.dataclass(frozen=True)
class Fix:
  """One named patch of upstream code.

  Attributes:
    name: The name used in `TFDP_COMPAT_DISABLE`.
    doc: Which upstream behaviour the fix corrects (the install function's
      docstring).
    probe: Returns what changed upstream under the fix (one sentence each):
      the names it patches or relies on that are gone, or upstream code that
      no longer reads them the way the fix assumes. Empty when the fix fits.
    install: Patches upstream; returns a callable that undoes the patch.
    without: What a run loses when the fix is not installed.
  """

  name: str
  doc: str
  probe: Callable[[], list[str]]
  install: Callable[[], Callable[[], None]]
  without: str = ""

  def changes(self) -> list[str]:
    """Runs the probe; a probe that raises counts as a change (it names what it could not find)."""
    try:
      return list(self.probe())
    except Exception as e:  # pylint: disable=broad-except
      return [f"probing raised {type(e).__name__}: {e}"]


REGISTRY: dict[str, Fix] = {}


def register(name: str, probe: Callable[[], list[str]], without: str):
  """Decorator: registers the decorated install function as the fix `name`."""

  def decorator(install):
    REGISTRY[name] = Fix(name=name, doc=inspect.cleandoc(install.__doc__ or ""),
                         probe=probe, install=install, without=without)
    return install

  return decorator


def patch_attr(owner, attr, replacement, fix_name):
  """Sets `owner.attr = replacement` and returns the undo callable.

  If `owner.attr` is already this fix (tfdp.compat was reloaded), nothing is
  patched twice.
  """
  original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
  if getattr(original, MARK, None) == fix_name:
    return lambda: None
  setattr(replacement, MARK, fix_name)

  def undo():
    setattr(owner, attr, original)

  setattr(owner, attr, replacement)
  return undo
