"""The public name `tfdp.summaries` (TensorBoard, evaluation and the end-of-run summary): the module tfdp.app.summaries."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tfdp.app.summaries")
