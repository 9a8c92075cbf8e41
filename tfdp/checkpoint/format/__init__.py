"""The checkpoint format: every name on disk, the typed records, their checks, the one commit and delete, the file-system seam, the save plan.

Owns:
  layout.py     every name in a checkpoint directory and a local tier (no TensorFlow);
  manifest.py   the typed records (Manifest, FileRecord, SlotEntries of SlotTensor) and their JSON (no TensorFlow);
  verify.py     checks of the bytes against a manifest: sizes, CRC-32, TF's CRC32C, slot files;
  slot_file.py  the local tier's slot files: a record's checks, read and receive with a CRC32C each;
  checksum.py   CRC32C, one library for every tensor's checksum (it releases the GIL; no TensorFlow);
  commit.py     the one commit point and the one delete of both tiers, set-aside, torn-save cleanup;
  directory.py  what a directory holds: its files by checkpoint and kind, TF's state file (read);
  fs.py         the file-system seam: fsync, atomic writes, the one JSON reader and writer, listing;
  private.py    private folders and files (modes, no symlinks);
  units.py      byte counts for people: human_bytes, parse_size;
  planner.py    the byte-balanced save plan;
  reads.py      a checkpoint's tensors as TF's save reads them: the full walk, the cached reads of frequent saves, PythonValue;
  items.py      a save's items, their sizes and host snapshot, the per-worker state.
May import: tfdp.errors, tfdp._version.
"""
