"""The checkpoint format: every name on disk, the typed records, the file-system seam, and the save plan.

Owns: the layout (layout.py), the manifest records and their verification
(manifest.py), fsync/atomic writes/deletion (fs.py), private folders and
files (private.py), the byte-balanced plan (planner.py), a save's items and
their host snapshot (items.py).
May import: tfdp.errors, tfdp._version.
"""
