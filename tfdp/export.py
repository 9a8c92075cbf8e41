"""The public name `tfdp.export` (a model or checkpoint as plain Keras and Hugging Face files): the module tfdp.app.export."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tfdp.app.export")
