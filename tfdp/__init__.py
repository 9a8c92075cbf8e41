"""tfdp: data-parallel training for Keras 3 on TensorFlow."""

from tfdp import compat as _compat

_compat.apply()

# pylint: disable=g-import-not-at-top,wrong-import-position
from tfdp import callbacks
from tfdp import data
from tfdp import errors
from tfdp import preemption
from tfdp.checkpoint import CheckpointManager
from tfdp.state import TrainState
from tfdp.strategy import make_strategy
from tfdp.training import fit

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "TrainState", "callbacks", "data", "errors", "fit",
    "make_strategy", "preemption",
]
