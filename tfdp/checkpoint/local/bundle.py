"""A TensorFlow tensor-bundle index over a local copy's slot, so that TF's own reader reads the copy.

A slot holds its tensors as a bundle's data file holds them (tfdp.checkpoint.format.slot_file),
so an index (a table of BundleEntryProto: dtype, shape, offset, size, masked
CRC32C) plus the data file's name, a symlink to the slot, make a standard
checkpoint: `tf.train.load_checkpoint` and `tf.train.Checkpoint.restore`
read it and check every tensor's CRC32C. The index is made from the record
alone, only when something needs TF to read the copy (a restore's checks).

The table is LevelDB's format, which TF's reader (tensorflow/core/lib/io)
reads: one data block holding every entry (each a restart point, keys
sorted, the header's empty key first), an empty meta-index block, an index
block, and the footer.
"""

import os
import struct

from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.framework import versions_pb2
from tensorflow.core.protobuf import tensor_bundle_pb2

from tfdp.checkpoint.format import checksum
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import slot_file

_MAGIC = 0xDB4775248B80FB57
_NO_COMPRESSION = b"\x00"
_BUNDLE_VERSION = 1  # kTensorBundleVersion


def _block(pairs) -> bytes:
  """A table block of (key, value) pairs, every entry a restart point (no key sharing)."""
  body, restarts = bytearray(), []
  for key, value in pairs:
    restarts.append(len(body))
    body += slot_file.varint(0) + slot_file.varint(len(key)) + slot_file.varint(len(value)) + key + value
  restarts = restarts or [0]
  return bytes(body) + struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack(
      "<I", len(restarts))


def _framed(out: bytearray, block: bytes) -> bytes:
  """Appends `block` and its trailer to `out`; returns its handle (offset, size)."""
  handle = slot_file.varint(len(out)) + slot_file.varint(len(block))
  crc = checksum.extend(checksum.value(block), _NO_COMPRESSION)
  out += block + _NO_COMPRESSION + struct.pack("<I", slot_file.mask(crc))
  return handle


def index_bytes(entries) -> bytes:
  """The `.index` file of a bundle whose one data file holds `entries` (SlotTensor records)."""
  header = tensor_bundle_pb2.BundleHeaderProto(
      num_shards=1, endianness=tensor_bundle_pb2.BundleHeaderProto.LITTLE,
      version=versions_pb2.VersionDef(producer=_BUNDLE_VERSION))
  pairs = [(b"", header.SerializeToString())]
  for e in sorted(entries, key=lambda e: e.key.encode()):
    proto = tensor_bundle_pb2.BundleEntryProto(
        dtype=slot_file.DTYPES[e.dtype].as_datatype_enum,
        shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in e.shape]),
        shard_id=0, offset=e.offset, size=e.size, crc32c=slot_file.mask(e.crc32c))
    pairs.append((e.key.encode(), proto.SerializeToString()))
  out = bytearray()
  data = _framed(out, _block(pairs))
  meta = _framed(out, _block([]))
  index = _framed(out, _block([(pairs[-1][0], data)]))
  footer = meta + index
  out += footer + b"\x00" * (40 - len(footer)) + struct.pack("<Q", _MAGIC)
  return bytes(out)


def write(prefix: str, slot_path: str, entries) -> None:
  """Makes checkpoint `prefix` of the slot at `slot_path`: its index, and its data file linked to the slot."""
  index, data = layout_lib.index_path(prefix), layout_lib.data_filename(prefix, 0, 1)
  # Temp names a private folder's cleanup removes (TF's own temp infix).
  tmp = f"{index}{layout_lib.TF_TMP_INFIX}{os.getpid()}"
  fs.write_atomic(index, index_bytes(entries), tmp=tmp, durable=False)
  link = f"{data}{layout_lib.TF_TMP_INFIX}{os.getpid()}"
  if os.path.lexists(link):
    os.remove(link)
  os.symlink(os.path.basename(slot_path), link)
  os.replace(link, data)

