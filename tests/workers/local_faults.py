"""Faults in the local tier, injected by wrapping its real functions in the test's (or a worker's) own process (tests/workers/ so both import it).

Each function returns a wrapper of the real one: install it with
`monkeypatch.setattr` (or assign it, in a worker process that ends with
the fault). The production code has no hook for them.
"""

import os
import signal

from tfdp.checkpoint.local import channel
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.local import slots


def writer_of(base) -> int:
  """The worker a copy is written by, from its manifest's fields known before the write."""
  (worker,) = base.writers
  return int(worker)


def before_each_copy(fn):
  """A `copies.write` that calls `fn(worker)` first (it may wait, sleep or raise), then writes the copy."""
  real = copies.write

  def write(slot, prefix, items, base, *args, **kwargs):
    fn(writer_of(base))
    return real(slot, prefix, items, base, *args, **kwargs)

  return write


def kill_after_tensors(count: int):
  """A `Slot._write_buffer` that SIGKILLs this process once `count` tensors' bytes are written (a fill cut short)."""
  real = slots.Slot._write_buffer  # pylint: disable=protected-access
  written = []

  def write_buffer(self, buf, offset, crc):
    if len(written) == count:
      os.kill(os.getpid(), signal.SIGKILL)
    written.append(offset)
    return real(self, buf, offset, crc)

  return write_buffer


def half_then(fn):
  """A `Channel.send_file` whose socket sends the first half of the file's bytes, then `fn()` (a SIGKILL).

  The frame's header is sent as the real one sends it; the receiver sees a
  copy cut short in the middle of its bytes.
  """
  real = channel.Channel.send_file

  def send_file(self, header, path, size):
    sock = self.sock

    class _HalfSocket:
      """The real socket, whose sendfile stops at half of the file."""

      def __getattr__(self, name):
        return getattr(sock, name)

      def sendfile(self, file, offset=0, count=None):
        half = size // 2
        if offset + count < half:
          return sock.sendfile(file, offset, count)
        if half > offset:
          sock.sendfile(file, offset, half - offset)
        fn()
        raise ConnectionError("injected: the sender stopped half way through the copy")

    self.sock = _HalfSocket()
    try:
      return real(self, header, path, size)
    finally:
      self.sock = sock

  return send_file
