"""Keras callbacks: exact backup and restore, periodic sharded checkpoints, throughput, and `tfdp.fit`.

Owns: BackupAndRestore (backup.py: the Keras hooks; its saves go to the
manager's tiers in one call a step), what it checks and says of its backups
(backup_watch.py: a backup_dir it cannot write, the interval "auto" chose, a
data position that dominates, why `fit` runs without the data hooks),
CheckpointEvery and Throughput (periodic.py), `tfdp.fit` (fit.py).
May import: tfdp.checkpoint, tfdp.resume, tfdp.data, tfdp.distribute,
tfdp.liveness, tfdp.goodput, tfdp.compat, tfdp.errors.
"""

from tfdp.callbacks.backup import BackupAndRestore
from tfdp.callbacks.periodic import CheckpointEvery, Throughput

__all__ = ["BackupAndRestore", "CheckpointEvery", "Throughput"]
