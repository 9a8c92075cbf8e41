"""Cheap checks, run at import, that upstream code still has the shape a fix was written for.

Each check returns what it found changed (one sentence each; empty: as
expected). Reading a function's source costs microseconds (its lines come
from its code object and linecache, with no tokenizing), so a fix's probe may
read every function it relies on: not only that a private name exists, but
that upstream still reads or writes it where the fix assumes.
"""

import inspect
import linecache
import types

from tensorflow.python.distribute import collective_all_reduce_strategy

_MISSING = object()


def _label(owner, name=None):
  base = getattr(owner, "__qualname__", None) or owner.__name__.rsplit(".", 1)[-1]
  return base if name is None else f"{base}.{name}"


def _lookup(owner, name, own):
  if own and isinstance(owner, type):
    return owner.__dict__.get(name, _MISSING)
  return getattr(owner, name, _MISSING)


def defines(owner, *names, own=False) -> list[str]:
  """The `names` `owner` lacks (with `own`, a class must define them itself, not inherit them)."""
  return [f"{_label(owner)} no longer {'defines' if own else 'has'} {name}"
          for name in names if _lookup(owner, name, own) is _MISSING]


def inherits(cls, *names) -> list[str]:
  """The `names` `cls` now overrides instead of inheriting them (the patch is on a base class)."""
  return [f"{_label(cls)} now overrides {name}" for name in names if name in cls.__dict__]


def _last_line(code: types.CodeType) -> int:
  """The last source line of `code` or of a function nested in it."""
  last = max((line for _, _, line in code.co_lines() if line is not None),
             default=code.co_firstlineno)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      last = max(last, _last_line(const))
  return last


def _source(owner, name):
  """(source of `owner.name` unwrapped past any fix, None) or (None, what went wrong)."""
  obj = _lookup(owner, name, own=False)
  if obj is _MISSING:
    return None, f"{_label(owner, name)} is gone"
  code = getattr(inspect.unwrap(obj), "__code__", None)
  lines = linecache.getlines(code.co_filename) if code is not None else []
  if not lines:
    return None, f"the source of {_label(owner, name)} cannot be read"
  return "".join(lines[code.co_firstlineno - 1:_last_line(code)]), None


def reads(owner, name, *snippets, ordered=False) -> list[str]:
  """The `snippets` missing from the source of `owner.name` (with `ordered`: or out of order).

  Args:
    owner: a class or module.
    name: the attribute whose source is read (a function or method).
    *snippets: exact text the source must contain.
    ordered: the snippets must occur in this order (each after the previous).

  Returns:
    What changed, one sentence per snippet.
  """
  source, problem = _source(owner, name)
  if problem:
    return [problem]
  changes, start = [], 0
  for snippet in snippets:
    at = source.find(snippet, start if ordered else 0)
    if at < 0:
      where = " where expected" if ordered and snippet in source else ""
      changes.append(f"{_label(owner, name)} no longer contains `{snippet}`{where}")
    elif ordered:
      start = at + len(snippet)
  return changes


def omits(owner, name, *snippets) -> list[str]:
  """The `snippets` now found in the source of `owner.name` (upstream fixed the bug itself)."""
  source, problem = _source(owner, name)
  if problem:
    return [problem]
  return [f"{_label(owner, name)} now contains `{s}`" for s in snippets if s in source]


def params(owner, name, leading=(), defaults=None) -> list[str]:
  """How the signature of `owner.name` differs: its first parameters, and some defaults.

  Args:
    owner: a class or module.
    name: the function or method.
    leading: the names its parameters must start with.
    defaults: parameter name -> the default it must have.

  Returns:
    What changed.
  """
  obj = _lookup(owner, name, own=False)
  if obj is _MISSING:
    return [f"{_label(owner, name)} is gone"]
  try:
    parameters = inspect.signature(obj).parameters
  except (TypeError, ValueError):
    return [f"the signature of {_label(owner, name)} cannot be read"]
  changes = []
  if tuple(parameters)[:len(leading)] != tuple(leading):
    changes.append(f"{_label(owner, name)} no longer takes ({', '.join(leading)}, ...)")
  for param, default in (defaults or {}).items():
    if param not in parameters:
      changes.append(f"{_label(owner, name)} no longer takes {param}")
    elif parameters[param].default != default:
      changes.append(f"{_label(owner, name)}'s {param} no longer defaults to {default!r}")
  return changes


def multi_worker_attributes() -> list[str]:
  """What changed in the attributes tfdp.distribute.cluster reads to tell a multi-worker strategy.

  `tfdp.distribute.cluster.is_multi_worker` and `resolve` read these from
  MultiWorkerMirroredStrategy's extended (with defaults that mean "one
  worker"): if TF stopped setting them, the fixes would silently never act.
  """
  return reads(collective_all_reduce_strategy.CollectiveAllReduceExtended,
               "_initialize_multi_worker", "self._cluster_spec = ", "self._task_type = ",
               "self._task_id = ", "self._num_workers = ")
