"""Keras callbacks: exact backup and restore, periodic sharded checkpoints, throughput, and `tfdp.fit`.

Owns: BackupAndRestore (backup.py) and what it watches (backup_watch.py),
CheckpointEvery and Throughput (periodic.py), `tfdp.fit` (fit.py).
May import: tfdp.checkpoint, tfdp.resume, tfdp.data, tfdp.distribute,
tfdp.liveness, tfdp.goodput, tfdp.compat, tfdp.errors.
"""

from tfdp.callbacks.backup import BackupAndRestore
from tfdp.callbacks.periodic import CheckpointEvery, Throughput

__all__ = ["BackupAndRestore", "CheckpointEvery", "Throughput"]
