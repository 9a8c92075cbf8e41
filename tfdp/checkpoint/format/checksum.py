"""CRC32C, the checksum of every tensor a local copy holds (no TensorFlow).

One owner for the library: ICRAR's `crc32c` (C, SSE4.2/ARMv8 instructions,
about 9.6 GB/s on this project's 2-vCPU machine), which releases the GIL
while it checksums a buffer of more than 32 KiB. A writer or receiver
thread checksumming a slot then leaves the training thread's Python free:
`google-crc32c`, used before, held the GIL for each 2 MB chunk
(docs/performance.md, "The GIL during the fill").
"""

import crc32c as _crc32c


def extend(crc: int, data) -> int:
  """The CRC32C of the bytes `crc` was of, followed by `data` (bytes, or a contiguous buffer)."""
  return _crc32c.crc32c(data, crc)  # Positional: keywords cost as much as a small buffer's checksum.


def value(data) -> int:
  """The CRC32C of `data`."""
  return _crc32c.crc32c(data)
