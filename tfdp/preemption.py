"""The public name `tfdp.preemption` (the agreed save-and-exit on SIGTERM): the module tfdp.liveness.preemption."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tfdp.liveness.preemption")
