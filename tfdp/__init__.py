"""tfdp: data-parallel training for Keras 3 on TensorFlow.

The package is lazy, so that `tfdp-launch` (tfdp.launch) starts without
TensorFlow: `import tfdp` loads nothing heavy, and each public name is
imported on first use. The Keras fixes of `tfdp.compat` are applied by a
one-shot import hook before any part of tfdp that may use Keras is used:

- `tfdp.make_strategy`, `from tfdp import callbacks`, `import tfdp.callbacks`,
  `from tfdp.checkpoint import CheckpointManager`, ...: the first tfdp module
  loaded other than tfdp.launch, tfdp.errors, tfdp.goodput and tfdp.compat
  itself applies them as soon as it has run, before the import statement
  returns;
- `import tfdp` in a program that has imported Keras already applies them at
  once (loading them then costs nothing);
- `import tfdp` first, then `import keras` (or `import tensorflow` and a first
  use of `tf.keras`): the hook applies them as soon as Keras has loaded, so a
  script that uses no tfdp name but `import tfdp` gets them too.
"""

import importlib
import sys
import threading
from typing import TYPE_CHECKING

from tfdp._version import __version__

# Public name -> the module that defines it (None: the name is a submodule).
_PUBLIC = {
    "CheckpointManager": "tfdp.checkpoint",
    "TrainState": "tfdp.resume.train_state",
    "callbacks": None,
    "cluster": None,
    "configure_gradients": "tfdp.gradients.settings",
    "data": None,
    "errors": None,
    "export": None,
    "fit": "tfdp.callbacks.fit",
    "goodput": None,
    "make_strategy": "tfdp.distribute.strategy",
    "preemption": None,
    "summaries": None,
}

__all__ = sorted(_PUBLIC)

# Submodules (with theirs) whose import does not apply tfdp.compat: the
# launcher's, tfdp-ckpt's and tfdp.goodput, which the launcher uses, and
# tfdp-train's, which checks its flags first (they import no TensorFlow, or
# only when asked), and tfdp.compat, which applies nothing by itself.
_WITHOUT_COMPAT = ("tfdp.launch", "tfdp.errors", "tfdp.compat", "tfdp.goodput",
                   "tfdp._version", "tfdp.checkpoint.format.layout", "tfdp.checkpoint.format.private",
                   "tfdp.checkpoint.format.fs", "tfdp.checkpoint.format.manifest",
                   "tfdp.checkpoint.format.directory", "tfdp.checkpoint.format.verify",
                   "tfdp.checkpoint.format.units", "tfdp.distribute.environment",
                   "tfdp.cli.ckpt", "tfdp.cli.ckpt_list", "tfdp.cli.ckpt_inspect", "tfdp.cli.train", "tfdp.distribute.kinds", "tfdp.gradients.settings")
# Packages whose own (lazy) __init__ does not apply it; their other
# submodules do.
_WITHOUT_COMPAT_EXACT = ("tfdp.checkpoint", "tfdp.cli", "tfdp.checkpoint.format",
                         "tfdp.checkpoint.persistent", "tfdp.checkpoint.local", "tfdp.checkpoint.schedule",
                         "tfdp.distribute",
                         "tfdp.gradients", "tfdp.liveness", "tfdp.resume", "tfdp.app")

if TYPE_CHECKING:
  # pylint: disable=g-import-not-at-top,g-bad-import-order
  from tfdp import callbacks, data, errors, goodput
  from tfdp.distribute import cluster
  from tfdp.app import export
  from tfdp.liveness import preemption
  from tfdp.app import summaries
  from tfdp.checkpoint import CheckpointManager
  from tfdp.gradients.settings import configure_gradients
  from tfdp.resume.train_state import TrainState
  from tfdp.distribute.strategy import make_strategy
  from tfdp.callbacks.fit import fit


def _needs_compat(name):
  if name == "keras":  # imported after tfdp: every Keras program gets the fixes
    return True
  if not name.startswith("tfdp.") or name in _WITHOUT_COMPAT_EXACT:
    return False
  return not any(name == m or name.startswith(m + ".") for m in _WITHOUT_COMPAT)


class _CompatHook:
  """Import hook: applies tfdp.compat as Keras, or the first tfdp module that may use it, finishes loading.

  It finds the module with the finders after it, and wraps the loader so
  that the fixes are applied right after the module ran, and before the
  import statement returns. Applying them later than the module's start
  means that nothing is imported while Python holds its global import lock
  (as it does around `find_spec`), and that tfdp.compat, whose own imports
  may include this very module, finds it complete. The hook leaves
  `sys.meta_path` once the fixes are applied.
  """

  def find_spec(self, fullname, path=None, target=None):
    if not _needs_compat(fullname):
      return None
    for finder in sys.meta_path:
      find = getattr(finder, "find_spec", None)
      if finder is self or find is None:
        continue
      spec = find(fullname, path, target)
      if spec is not None:
        if hasattr(spec.loader, "exec_module"):
          spec.loader = _ThenApplyCompat(spec.loader)
        return spec
    return None

  def invalidate_caches(self):
    pass


class _ThenApplyCompat:
  """A loader that runs the real one, then applies tfdp.compat; it leaves no trace on the module."""

  def __init__(self, loader):
    self._loader = loader

  def __getattr__(self, name):
    return getattr(self._loader, name)

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    module.__spec__.loader = module.__loader__ = self._loader
    self._loader.exec_module(module)
    _apply_compat()


_HOOK = _CompatHook()
_applying = threading.local()


def _apply_compat():
  """Applies tfdp.compat's fixes once; the hook then leaves `sys.meta_path`."""
  compat = sys.modules.get("tfdp.compat")
  if compat is not None and getattr(compat.__spec__, "_initializing", False):
    return  # tfdp.compat's own imports got here: the next tfdp module applies it
  if getattr(_applying, "active", False):
    return  # a fix being installed imported a tfdp module
  _applying.active = True
  try:
    from tfdp import compat  # pylint: disable=g-import-not-at-top,redefined-outer-name
    compat.apply()  # idempotent; raises ConfigError for a bad TFDP_COMPAT_DISABLE
  finally:
    _applying.active = False
  try:
    sys.meta_path.remove(_HOOK)
  except ValueError:
    pass


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
  module_name = _PUBLIC[name]
  if module_name is None:
    value = importlib.import_module(f"tfdp.{name}")
  else:
    value = getattr(importlib.import_module(module_name), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))


sys.meta_path.insert(0, _HOOK)
if "keras" in sys.modules:
  _apply_compat()
