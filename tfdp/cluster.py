"""The public name `tfdp.cluster` (who this process is in the job): the module tfdp.distribute.cluster."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tfdp.distribute.cluster")
