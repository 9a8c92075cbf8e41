"""Where tfdp meets other engines; each submodule imports its engine only when used.

Owns: ray.py (Ray Train: each committed backup reported to Ray, `backup_of`, the goodput line).
May import: tfdp.goodput, tfdp.checkpoint.format, tfdp.errors.
"""
