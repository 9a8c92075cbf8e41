"""The persistent tier: standard TF checkpoints written in shards by every worker, merged and committed by the chief.

Owns:
  writer.py     a save's walk: shards written and fsynced per worker, markers, the chief's merge and seal, the wait for the commit;
  catalog.py    the managed checkpoints of a directory as tf.train.CheckpointManager sees them, TF's state file (written);
  retention.py  what to keep;
  lease.py      one writer per directory;
  session.py    the job's session, agreed at start.
May import: tfdp.checkpoint.format, tfdp.distribute, tfdp.errors.
"""
