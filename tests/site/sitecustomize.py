"""Start-up of every Python process the tests start: TensorFlow and Keras imported with the collector paused, then frozen, without Keras's optional pandas.

tests/conftest.py puts this folder first on PYTHONPATH, so Python's `site`
imports this module in every process the test session starts (workers,
launchers, scripts), before their own code. Test processes only: nothing of
tfdp depends on it, and a user's process never has it.

Until Keras is loaded, the first `import` of tensorflow, keras or tfdp (and
the imports it makes) runs with the cyclic garbage collector paused, and when
TensorFlow and Keras are both loaded every object made so far is frozen
(`gc.freeze`: the collector no longer scans them) and the plain `import`
comes back. Importing them makes about 270,000 long-lived objects, and
while they are tracked every full collection walks them all. Measured with
gc.callbacks (TF 2.21, Keras 3.15, Python 3.11, 2026-12-06): the collector's
time in a data_resume.py process of two 30-step fits went from 0.49 to 0.02
CPU-s (of about 6), in a matrix_worker.py process of 17 fits from 2.09 to
0.98 CPU-s (of 46), with the same weights bit for bit; importing TF, Keras
and tfdp took 2.38 CPU-s against 2.86 (the mean of 6 runs each). The
collector runs as usual afterwards, over the objects made since.

Keras's own `import pandas` in that first import finds no pandas, as in a
user's environment without it: tfdp does not use pandas, which is installed
here only because the test extra's `ray[train]` needs it, and Keras imports
it only to take DataFrames, which nothing in tfdp or the tests passes. Each
TensorFlow process then skips importing pandas and pyarrow: 1.90 against
2.16 CPU-s for importing TF, Keras and tfdp (the mean of 8 runs each,
2026-12-07; 2.65 against 3.01 on a busier host). A process that imported
pandas before (Ray's workers), and any import of it by another module or
later, gets it as usual.

TFDP_TEST_PLAIN_GC=1 leaves the collector and Keras's pandas alone;
TFDP_TEST_KERAS_PANDAS=1 the latter alone. tests/test_user_path.py's
processes do not have this folder on their path.
"""

import builtins
import gc
import os
import sys

_HEAVY = frozenset({"tensorflow", "keras", "tfdp"})
_import = builtins.__import__
_KERAS_PANDAS = bool(os.environ.get("TFDP_TEST_KERAS_PANDAS"))


def _import_paused(name, globals=None, locals=None, fromlist=(), level=0):  # pylint: disable=redefined-builtin
  if name == "pandas" and not level and not _KERAS_PANDAS and "pandas" not in sys.modules:
    importer = sys._getframe(1).f_globals.get("__name__", "")  # pylint: disable=protected-access
    if importer.partition(".")[0] == "keras":  # its pandas is optional: `except ImportError`
      raise ModuleNotFoundError("No module named 'pandas' (for Keras, in the tests)", name="pandas")
  if level or name.partition(".")[0] not in _HEAVY or not gc.isenabled():
    return _import(name, globals, locals, fromlist, level)
  gc.disable()
  try:
    return _import(name, globals, locals, fromlist, level)
  finally:
    gc.enable()
    if "keras" in sys.modules and "tensorflow" in sys.modules:
      gc.freeze()
      if builtins.__import__ is _import_paused:
        builtins.__import__ = _import


if not os.environ.get("TFDP_TEST_PLAIN_GC"):
  builtins.__import__ = _import_paused
