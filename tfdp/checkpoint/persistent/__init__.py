"""The persistent tier: standard TF checkpoints written in shards by every worker, merged and committed by the chief.

Owns: the writer (writer.py), what a directory holds (catalog.py), what to
keep (retention.py), one writer per directory (lease.py), the job's session
(session.py).
May import: tfdp.checkpoint.format, tfdp.distribute, tfdp.errors.
"""
