"""Where a peer recovery's seconds go at both ends, measured in a bench child by wrapping the real functions.

scripts/bench_tiers.py's restore child calls `install()` before the restore
(with --peer_probe): the transfer's real functions are wrapped in that
process (no hook in tfdp), and `take()` returns, for this worker:

- stamps (time.time(), comparable across the two processes of one host):
  `agreed` (the agreement that lets the holder send), `connected` (the
  holder's handshake done), `send_start`/`send_end` (Channel.send_file),
  `mac_end` (the holder's MAC thread done), `recv_start`/`recv_end`
  (Incoming.receive, the receiver);
- the holder's sendfile pieces: how many, their bytes, the seconds inside
  os.sendfile and between the calls (poll, Python, the GIL);
- per thread of the process, over the transfer window (from `agreed`, or
  `recv_start`, to its end): CPU seconds (user, system: /proc/self/task/*/stat)
  and seconds runnable but waiting for a CPU (/proc/self/task/*/schedstat),
  by thread name; and the whole machine's CPU seconds by kind (/proc/stat:
  user, system, softirq, steal, idle) and page faults (/proc/vmstat).
"""

import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK")
_state = {"stamps": {}, "pieces": [], "windows": {}}
_lock = threading.Lock()


def _threads():
  """{tid: (name, user s, system s, run s, runnable-waiting s)} of this process's threads now."""
  names = {t.native_id: t.name for t in threading.enumerate()}
  out = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
      with open(f"/proc/self/task/{tid}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    except OSError:
      continue
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    name = names.get(int(tid), comm)
    out[int(tid)] = (name, int(fields[11]) / _TICK, int(fields[12]) / _TICK,
                     int(run_ns) / 1e9, int(wait_ns) / 1e9)
  return out


def _own():
  """(CPU s, runnable-waiting s, voluntary and involuntary switches) of the calling thread so far."""
  with open("/proc/thread-self/schedstat") as f:
    run_ns, wait_ns, _ = f.read().split()
  switches = {}
  with open("/proc/thread-self/status") as f:
    for line in f:
      if "ctxt_switches" in line:
        k, v = line.split(":")
        switches[k] = int(v)
  return (int(run_ns) / 1e9, int(wait_ns) / 1e9, switches.get("voluntary_ctxt_switches", 0),
          switches.get("nonvoluntary_ctxt_switches", 0))


def _thread_run(label, run):
  """`run` (a thread's target) that records its thread's CPU, waits and switches under `label`."""

  def wrapped(self, *a, **k):
    start = _own()
    try:
      return run(self, *a, **k)
    finally:
      end = _own()
      with _lock:
        _state.setdefault("threads", {})[label] = {
            "cpu": round(end[0] - start[0], 3), "runnable_waiting": round(end[1] - start[1], 3),
            "voluntary_switches": end[2] - start[2], "involuntary_switches": end[3] - start[3]}

  return wrapped


def _machine():
  with open("/proc/stat") as f:
    cpu = f.readline().split()[1:]
  names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
  out = {n: int(v) / _TICK for n, v in zip(names, cpu)}
  with open("/proc/self/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  out["process_cpu"] = (int(fields[11]) + int(fields[12])) / _TICK
  with open("/proc/vmstat") as f:
    for line in f:
      k, v = line.split()
      if k in ("pgfault", "pgmajfault", "pgalloc_normal", "thp_fault_alloc"):
        out[k] = int(v)
  return out


def _open(window):
  with _lock:
    _state["windows"][window] = {"t": time.time(), "threads": _threads(), "machine": _machine()}


def _close(window):
  with _lock:
    start = _state["windows"].get(window)
  if start is None or "seconds" in start:
    return
  now, machine = _threads(), _machine()
  per = {}
  for tid, (name, user, system, run, wait) in now.items():
    _, u0, s0, r0, w0 = start["threads"].get(tid, (name, 0.0, 0.0, 0.0, 0.0))
    d = (user - u0, system - s0, run - r0, wait - w0)
    if d[2] > 0.005 or d[3] > 0.005:
      key = name if name not in per else f"{name}#{tid}"
      per[key] = {"user": round(d[0], 3), "system": round(d[1], 3), "cpu": round(d[2], 3),
                  "runnable_waiting": round(d[3], 3)}
  with _lock:
    start.update(seconds=time.time() - start["t"], per_thread=per,
                 machine={k: round(v - start["machine"][k], 3) for k, v in machine.items()})
    del start["threads"]


def _stamp(name):
  with _lock:
    _state["stamps"].setdefault(name, time.time())


def install():
  """Wraps the transfer's functions in this process (a bench child's, before its restore)."""
  from tfdp.checkpoint import recovery  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.local import channel  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.local import copies  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.local import outbound  # pylint: disable=g-import-not-at-top

  transfer = recovery.TieredRestore._transfer  # pylint: disable=protected-access

  def _transfer(self, *a, **k):
    _stamp("agreed")
    _open("transfer")
    try:
      return transfer(self, *a, **k)
    finally:
      _stamp("transfer_end")
      _close("transfer")

  recovery.TieredRestore._transfer = _transfer  # pylint: disable=protected-access

  connect = outbound.Outbound.connect

  def _connect(self, to):
    out = connect(self, to)
    _stamp("connected")
    return out

  outbound.Outbound.connect = _connect

  send_file = channel.Channel.send_file

  def _send_file(self, *a, **k):
    _stamp("send_start")
    real = os.sendfile

    def sendfile(*args):
      t = time.perf_counter()
      n = real(*args)
      with _lock:
        _state["pieces"].append((t, time.perf_counter(), n))
      return n

    os.sendfile = sendfile
    try:
      return send_file(self, *a, **k)
    finally:
      os.sendfile = real
      _stamp("send_end")

  channel.Channel.send_file = _send_file

  mac_run = channel._FileMac.run  # pylint: disable=protected-access

  def _mac_run(self):
    try:
      return mac_run(self)
    finally:
      _stamp("mac_end")

  channel._FileMac.run = _thread_run("holder MAC", _mac_run)  # pylint: disable=protected-access
  from tfdp.checkpoint.format import slot_file  # pylint: disable=g-import-not-at-top
  # The receiver's threads, before issue 45's change (_Landing, _Prefault) and after (_Pipe).
  for name, cls in (("landing", "_Landing"), ("prefault", "_Prefault")):
    if hasattr(slot_file, cls):
      getattr(slot_file, cls).run = _thread_run(name, getattr(slot_file, cls).run)
  if hasattr(slot_file, "_Pipe"):
    stage = slot_file._Pipe.run  # pylint: disable=protected-access
    slot_file._Pipe.run = lambda self, k: _thread_run(("check", "store")[k], lambda s: stage(s, k))(self)  # pylint: disable=protected-access
  blob_reader = channel.Channel.blob_reader

  def _blob_reader(self):
    recv_into, digest = blob_reader(self)
    calls = _state.setdefault("recv_calls", [0, 0])

    def counted(view):
      n = recv_into(view)
      calls[0] += 1
      calls[1] += n
      return n

    return counted, digest

  channel.Channel.blob_reader = _blob_reader

  receive = copies.Incoming.receive

  def _receive(self, conn):
    _stamp("recv_start")
    _open("receive")
    try:
      return _thread_run("recv", lambda s, c: receive(s, c))(self, conn)
    finally:
      _stamp("recv_end")
      _close("receive")

  copies.Incoming.receive = _receive

  send_file_timed = channel.Channel.send_file
  channel.Channel.send_file = _thread_run("holder send", send_file_timed)


def take() -> dict:
  """What was measured in this process (JSON-able)."""
  with _lock:
    out = {"stamps": dict(_state["stamps"]), "windows": dict(_state["windows"])}
    pieces = list(_state["pieces"])
    out["threads"] = dict(_state.get("threads", {}))
    if "recv_calls" in _state:
      out["recv_calls"], out["recv_bytes"] = _state["recv_calls"]
  if pieces:
    inside = sum(b - a for a, b, _ in pieces)
    between = sum(pieces[i + 1][0] - pieces[i][1] for i in range(len(pieces) - 1))
    sizes = sorted(n for _, _, n in pieces)
    out["sendfile"] = {"calls": len(pieces), "bytes": sum(sizes), "inside_s": round(inside, 3),
                       "between_s": round(between, 3), "median_piece": sizes[len(sizes) // 2],
                       "max_piece": sizes[-1]}
  return out
