"""Peer recovery's transfer alone beside raw TCP of the same bytes: two processes, no TF job.

What a holder and a receiver do between the agreement and the restore, through the real code:
the holder fills a slot (tfdp.checkpoint.local.slots) and sends it (`Channel.send_file` after the
handshake); the receiver checks the offer (`copies.incoming`), receives the bytes into a fresh slot
of its own (`Incoming.receive`: allocate, recv, check as they land) and checks the frame's MAC
(`end_frame`). Beside it, in the same run and interleaved, a raw TCP transfer of the same bytes into
a fresh buffer (scripts/bench_tiers.py's floor), and the floor of any transfer that authenticates
every byte as the side channel does: raw TCP with the side channel's MAC of a frame's blobs
(tfdp.checkpoint.local.channel.blobs_mac) over the bytes at both ends, each on a thread beside the
sending or receiving one (`raw_mac`). Seconds are the receiver's, from the first byte of
the offer's header to the copy checked in its slot, and the CPU seconds of both processes (what a
loaded machine's wall time hides); fastest and median of --reps.

  .venv/bin/python scripts/bench_peer_transfer.py --mb=1024 --reps=5
"""

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

import numpy as np

from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.local import channel as channel_lib
from tfdp.checkpoint.local import copies
from tfdp.checkpoint.local import slots
from tfdp.checkpoint.local import wire

_SECRET = b"bench-secret" * 4
_BLOBS_KEY = channel_lib.blobs_key(_SECRET)
_VAR_MB = 16


def _copy(directory: str, mb: int):
  """A holder's copy of `mb` MB of float32 tensors (16 MB each): (slot path, manifest)."""
  rng = np.random.default_rng(0)
  sources = [slots.source(f"v{i}", rng.random(_VAR_MB << 18, dtype=np.float32))
             for i in range(max(1, mb // _VAR_MB))]
  slot = slots.Slot(os.path.join(directory, "ckpt.slot-0"))
  entries, used = slot.fill(sources)
  slot.close()
  record = manifest_lib.FileRecord("ckpt.slot-0", used, entries=entries)
  man = manifest_lib.Manifest(checkpoint_number=7, tier="local", step=7, prefix="ckpt-7",
                              files=[record], total_bytes=used)
  return slot.path, man


def _mac_of(data) -> bytes:
  """The side channel's MAC of a frame whose one blob is `data`."""
  mac = channel_lib.blobs_mac(_BLOBS_KEY, 0)
  mac.update(data)
  return mac.digest()


def _holder(port, path, man_json, size, kind, cpu):
  sock = socket.create_connection(("localhost", port))
  start = time.process_time()
  if kind in ("raw", "raw_mac"):
    data = np.ones(size, np.uint8)
    mac = threading.Thread(target=_mac_of, args=(memoryview(data),))
    if kind == "raw_mac":
      mac.start()
    sock.sendall(memoryview(data))
    if kind == "raw_mac":
      mac.join()
  else:
    chan = channel_lib.client_handshake(sock, _SECRET, 0, 1)
    chan.send_file({"kind": wire.COPY, "step": 7, "from": 0, "manifest": man_json}, path, size)
  cpu.value = time.process_time() - start
  sock.recv(1)
  sock.close()


def _receive(server, directory, size, kind):
  conn, _ = server.accept()
  cpu = time.process_time()
  if kind in ("raw", "raw_mac"):
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    landed = threading.Condition()
    mac = channel_lib.blobs_mac(_BLOBS_KEY, 0)

    def follow():  # MACs what has landed, 2 MB at a time, as the side channel's checker does.
      done = 0
      while done < size:
        with landed:
          landed.wait_for(lambda: got > done)
          end = min(got, done + (2 << 20))
        mac.update(view[done:end])
        done = end

    checker = threading.Thread(target=follow)
    t = time.perf_counter()
    if kind == "raw_mac":
      checker.start()
    while got < size:
      k = conn.recv_into(view[got:])
      with landed:
        got += k
        landed.notify()
    if kind == "raw_mac":
      checker.join()
    seconds, phases = time.perf_counter() - t, {}
  else:
    _, chan = channel_lib.serve_handshake(conn, _SECRET, 1, 2)
    chan.settimeout(None)
    t = time.perf_counter()
    header = chan.read_header()
    wire.check_header(header, 0, 2)
    layout = layout_lib.Layout(directory)
    offer = copies.incoming(layout, slots.Slot(layout.slot(1)), header["step"],
                            header["manifest"], header["sizes"])
    offer.receive(chan)
    chan.end_frame()
    seconds, phases = time.perf_counter() - t, offer.times.take()
    offer.slot.close()
    os.unlink(layout.slot(1))
  phases["receiver_cpu"] = time.process_time() - cpu
  conn.sendall(b"k")
  conn.close()
  return seconds, phases


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mb", type=int, default=1024)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--dir", default="/dev/shm")
  args = parser.parse_args()
  holder_dir = tempfile.mkdtemp(prefix="tfdp_bench_peer_h_", dir=args.dir)
  receiver_dir = tempfile.mkdtemp(prefix="tfdp_bench_peer_r_", dir=args.dir)
  ctx = multiprocessing.get_context("fork")
  try:
    path, man = _copy(holder_dir, args.mb)
    size = man.slot.size
    results = {"raw": [], "raw_mac": [], "peer": []}
    for rep in range(args.reps):
      for kind in results:
        server = socket.create_server(("localhost", 0))
        cpu = ctx.Value("d", 0.0)
        proc = ctx.Process(target=_holder, args=(server.getsockname()[1], path, man.to_json(),
                                                  size, kind, cpu))
        proc.start()
        seconds, phases = _receive(server, receiver_dir, size, kind)
        proc.join()
        phases["sender_cpu"] = cpu.value
        server.close()
        results[kind].append((seconds, phases))
        print(f"rep {rep} {kind}: {seconds:.3f} s " + " ".join(
            f"{k} {v:.3f}" for k, v in sorted(phases.items())), flush=True)
    for kind, rows in results.items():
      s = [r[0] for r in rows]
      cpu = [r[1]["receiver_cpu"] + r[1]["sender_cpu"] for r in rows]
      print(f"{kind}: {size / 1e6:.0f} MB, fastest {min(s):.3f} s, median "
            f"{statistics.median(s):.3f} s ({args.reps} runs); CPU seconds of both processes: "
            f"least {min(cpu):.3f}, median {statistics.median(cpu):.3f}")
    fastest = {kind: min(r[0] for r in rows) for kind, rows in results.items()}
    print(f"peer transfer / raw TCP, fastest of each: {fastest['peer'] / fastest['raw']:.2f}x; "
          f"raw TCP with the blobs' MAC at both ends / raw TCP: "
          f"{fastest['raw_mac'] / fastest['raw']:.2f}x; peer / that floor: "
          f"{fastest['peer'] / fastest['raw_mac']:.2f}x; load average {os.getloadavg()}")
  finally:
    shutil.rmtree(holder_dir, ignore_errors=True)
    shutil.rmtree(receiver_dir, ignore_errors=True)


if __name__ == "__main__":
  main()
