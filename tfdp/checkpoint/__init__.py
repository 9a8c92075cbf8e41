"""Sharded, atomic, verified, optionally asynchronous checkpoints across workers."""

from tfdp.checkpoint.manager import CheckpointManager
from tfdp.checkpoint.manifest import verify
from tfdp.checkpoint.restore import load_per_worker
from tfdp.checkpoint.retention import KeepBest

__all__ = ["CheckpointManager", "KeepBest", "load_per_worker", "verify"]
