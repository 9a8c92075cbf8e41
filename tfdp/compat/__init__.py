"""Version-gated, probed Keras 3 fixes for fit/evaluate/predict under mirrored strategies (one worker or several).

`apply()` (run by `import tfdp` before any part of tfdp that may use Keras)
installs every fix whose probe finds the upstream code it patches as the fix
expects, on any Keras/TensorFlow version: a fix whose probe fails is not
installed, a warning says what changed, and `skipped()` keeps the reason.
A fix is a small repair of upstream code, or the install of a tfdp feature
that must patch upstream (the gradient path); the feature itself lives in
its own package.

Owns:
- registry.py: what a fix is, the registry, how a fix patches an attribute;
- probes.py: the probes that read upstream's code;
- strategy_fixes.py: symbolic_build_batch, reduce_mean_axis, steps_per_execution_inline,
  non_trainable_mean_aggregation, concat_gather_dtypes;
- multi_step.py: steps_per_execution_inline's loop, the step traced inline;
- fit_fixes.py: fit_data_state, chief_only_verbose;
- file_fixes.py: chief_only_files;
- gradient_path.py: gradient_path, the probes and install of tfdp.gradients.path;
- deadline.py: collective_deadline (a stuck multi-worker step is one line and exit 70).
May import: tfdp.gradients, tfdp.distribute, tfdp.liveness,
tfdp.resume.fit_hooks, tfdp.errors.
"""

import os
import threading
from typing import Callable

from absl import logging
import keras
import tensorflow as tf

# The registry is filled in this order (the order fixes are installed in).
from tfdp.compat import strategy_fixes  # pylint: disable=unused-import
from tfdp.compat import fit_fixes  # pylint: disable=unused-import
from tfdp.compat import file_fixes  # pylint: disable=unused-import
from tfdp.compat import gradient_path  # pylint: disable=unused-import
from tfdp.compat import deadline  # pylint: disable=unused-import
from tfdp.compat.registry import Fix
from tfdp.compat.registry import REGISTRY as _REGISTRY

__all__ = ["DISABLE_ENV", "Fix", "TESTED_KERAS", "TESTED_TF", "applied", "apply",
           "disabled_fixes", "fixes", "revert", "skipped"]

# Versions every fix was written against and tested on (prefixes).
TESTED_KERAS = "3.15."
TESTED_TF = "2.21."

DISABLE_ENV = "TFDP_COMPAT_DISABLE"

_applied: dict[str, Callable[[], None]] = {}
_skipped: dict[str, str] = {}
_lock = threading.Lock()
_warned_versions = False


def disabled_fixes() -> frozenset[str]:
  """Returns the names of the fixes `TFDP_COMPAT_DISABLE` turns off.

  Raises:
    ConfigError: if the variable names a fix that does not exist.
  """
  from tfdp import errors  # pylint: disable=g-import-not-at-top

  raw = os.environ.get(DISABLE_ENV, "").strip()
  if not raw:
    return frozenset()
  names = {n.strip() for n in raw.split(",") if n.strip()}
  if "all" in names:
    return frozenset(_REGISTRY)
  unknown = names - set(_REGISTRY)
  if unknown:
    raise errors.ConfigError(
        f"{DISABLE_ENV} names unknown fixes {sorted(unknown)}; use 'all' or a "
        f"comma-separated subset of {sorted(_REGISTRY)}.")
  return frozenset(names)


def fixes() -> dict[str, Fix]:
  """Returns the registered fixes by name."""
  return dict(_REGISTRY)


def applied() -> frozenset[str]:
  """Returns the names of the fixes currently installed."""
  return frozenset(_applied)


def skipped() -> dict[str, str]:
  """Returns the fixes the last `apply()` left out because upstream changed under them.

  A fix is left out when its probe finds that a name it patches or relies on
  is gone, or that upstream no longer reads it the way the fix assumes. A
  fix turned off by `TFDP_COMPAT_DISABLE` is not in it (see
  `disabled_fixes()`); nothing is after `revert()`.

  Returns:
    Fix name -> what changed (sentences joined by "; "), plus what a run
    loses without it.
  """
  return dict(_skipped)


def _versions_tested():
  return keras.__version__.startswith(TESTED_KERAS) and tf.__version__.startswith(TESTED_TF)


def apply() -> frozenset[str]:
  """Installs every registered fix not disabled by `TFDP_COMPAT_DISABLE` whose probe passes.

  Idempotent. Each fix's probe runs before it is installed, on every
  version: a fix whose probe fails is not installed, is listed by
  `skipped()`, and a warning names it and what changed (once per reason).
  Off the tested versions (Keras 3.15.x, TensorFlow 2.21.x) a warning says
  so, once.

  Returns:
    The names of the fixes installed after the call.

  Raises:
    ConfigError: if `TFDP_COMPAT_DISABLE` names an unknown fix.
  """
  global _warned_versions
  disabled = disabled_fixes()
  with _lock:
    if not _versions_tested() and not _warned_versions:
      _warned_versions = True
      logging.warning(
          "tfdp.compat was tested on Keras %sx and TensorFlow %sx, found Keras %s and "
          "TensorFlow %s; installing only the fixes whose upstream code still looks as "
          "expected.", TESTED_KERAS, TESTED_TF, keras.__version__, tf.__version__)
    for name, fix in _REGISTRY.items():
      if name in _applied:
        continue
      if name in disabled:
        _skipped.pop(name, None)
        logging.info("tfdp.compat: %s disabled by %s.", name, DISABLE_ENV)
        continue
      changes = fix.changes()
      if changes:
        reason = f"{'; '.join(changes)} (without it, {fix.without})"
        if _skipped.get(name) != reason:
          logging.warning("tfdp.compat: skipping %s: the upstream code it patches changed: %s.",
                          name, reason)
        _skipped[name] = reason
        continue
      _skipped.pop(name, None)
      _applied[name] = fix.install()
    return frozenset(_applied)


def revert() -> None:
  """Removes every installed fix, restoring upstream behaviour (and forgets the skipped ones)."""
  with _lock:
    _skipped.clear()
    for name in reversed(list(_applied)):
      _applied.pop(name)()
