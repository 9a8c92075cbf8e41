"""Sharded, atomic, verified, optionally asynchronous checkpoints across workers.

Owns:
- manager.py: the face, tf.train.CheckpointManager's API;
- tiers.py: the two tiers it holds, and the one place a save's snapshot goes to those due;
- restore.py: reading one checkpoint, verified; restorer.py: the agreed restore of a directory;
- recovery.py: the agreed restore across the tiers (local, peer, persistent);
- model_match.py: a checkpoint checked against the model before any assignment.
Below them: when a save runs and on which thread (schedule/), the format (format/),
the persistent tier (persistent/) and the local tier (local/, built from its LocalOptions).
May import: tfdp.distribute, tfdp.errors.

Lazy, as the `tfdp` package: `tfdp.checkpoint.format.layout` (every file name, no
TensorFlow) can be imported by the launcher; the public names load on use.
"""

import importlib

# Public name -> the module that defines it.
_PUBLIC = {
    "CheckpointManager": "tfdp.checkpoint.manager",
    "KeepBest": "tfdp.checkpoint.persistent.retention",
    "load_per_worker": "tfdp.checkpoint.restore",
    "verify": "tfdp.checkpoint.format.verify",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'tfdp.checkpoint' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))
