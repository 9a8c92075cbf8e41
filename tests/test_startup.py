"""tfdp.distribute.startup: a worker whose peers have not started names them, and Ctrl-C, SIGTERM and a deadline end its wait."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import shared
from tests.conftest import REPO
from tfdp import errors
from tfdp.distribute import startup
from tfdp.launch import free_ports


def _config(ports, index=0, chief=False):
  hosts = [f"localhost:{p}" for p in ports]
  cluster = {"chief": hosts[:1], "worker": hosts[1:]} if chief else {"worker": hosts}
  task = ({"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
          ) if chief else {"type": "worker", "index": index}
  return {"cluster": cluster, "task": task}


def test_tasks_of_names_the_others_by_tfdp_index():
  own, peers = startup.tasks_of(_config([1, 2, 3], index=1, chief=True))
  assert own == "localhost:2"
  assert peers == [(0, "localhost:1"), (2, "localhost:3")]
  assert startup.tasks_of(None) == (None, [])
  many = [(i, f"h{i}:1") for i in range(1, 12)]
  assert startup.describe(many).endswith("worker 8 (h8:1) and 3 more")


def test_startup_timeout_from_argument_then_environment(monkeypatch):
  monkeypatch.delenv(startup.TIMEOUT_ENV, raising=False)
  assert startup.startup_timeout(None) is None
  monkeypatch.setenv(startup.TIMEOUT_ENV, "12")
  assert startup.startup_timeout(None) == 12.0
  assert startup.startup_timeout(3) == 3.0
  with pytest.raises(errors.ConfigError, match="positive"):
    startup.startup_timeout(0)
  monkeypatch.setenv(startup.TIMEOUT_ENV, "soon")
  with pytest.raises(errors.ConfigError, match="TFDP_STARTUP_TIMEOUT='soon'"):
    startup.startup_timeout(None)


def test_returns_once_the_peer_listens_and_frees_its_own_port():
  own, peer = free_ports(2)
  with socket.create_server(("", peer)):
    startup.wait_for_peers(_config([own, peer]), timeout=5)
  with socket.create_server(("", own)):  # TF's server can take the port now.
    pass


def test_deadline_exits_2_naming_the_missing_peer(monkeypatch, caplog):
  monkeypatch.setenv(startup.REPORT_ENV, "0.3")
  own, peer = free_ports(2)
  start = time.monotonic()
  with pytest.raises(SystemExit) as exit_info:
    startup.wait_for_peers(_config([own, peer]), timeout=1.0)
  assert exit_info.value.code == 2
  assert time.monotonic() - start < 5
  text = caplog.text
  assert f"waiting for worker 1 (localhost:{peer}) to start" in text
  assert f"worker 1 (localhost:{peer}) did not start within 1 s" in text


LONE = ("import tfdp, sys; tfdp.make_strategy(); print('STRATEGY-BUILT'); sys.exit(0)")


def _lone(ports, **env):
  config = json.dumps(_config(ports))
  return subprocess.Popen([sys.executable, "-c", LONE], cwd=REPO,
                          env=shared.environ(TF_CONFIG=config, TF_CPP_MIN_LOG_LEVEL="2", **env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text, seconds):
  """Lines of `proc` until one holds `text` (fails after `seconds`)."""
  seen = []
  deadline = time.monotonic() + seconds
  os.set_blocking(proc.stdout.fileno(), False)
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if line:
      seen.append(line)
      if text in line:
        return seen
    elif proc.poll() is not None:
      break
    else:
      time.sleep(0.05)
  raise AssertionError(f"no {text!r} within {seconds}s: {''.join(seen)[-3000:]}")


@pytest.mark.slow
def test_lone_worker_says_whom_it_waits_for_and_ctrl_c_ends_it():
  """One worker of a 2-worker TF_CONFIG alone: the waiting line within 40 s; SIGINT or SIGTERM: exit 2 within 5 s."""
  runs = {sig: free_ports(2) for sig in (signal.SIGINT, signal.SIGTERM)}
  procs = {sig: _lone(ports, TFDP_STARTUP_REPORT_SECONDS="2") for sig, ports in runs.items()}
  deadline_ports = free_ports(2)
  # Beside the two above, whose wait is 2 s to their first report: a longer
  # deadline would only keep the test waiting for it.
  timed = _lone(deadline_ports, TFDP_STARTUP_TIMEOUT="2")
  try:
    for sig, proc in procs.items():
      peer = f"worker 1 (localhost:{runs[sig][1]})"
      _wait_for(proc, f"waiting for {peer} to start", 40)
      sent = time.monotonic()
      proc.send_signal(sig)
      code = proc.wait(timeout=10)
      assert time.monotonic() - sent < 5
      rest = proc.stdout.read()
      assert code == 2, rest
      lines = [l for l in rest.splitlines() if "tfdp:" in l]
      assert lines == [l for l in lines if f"{sig.name} while waiting for {peer}" in l], rest
      assert len(lines) == 1, rest
    out, _ = timed.communicate(timeout=60)
    assert timed.returncode == 2, out
    assert f"worker 1 (localhost:{deadline_ports[1]}) did not start within 2 s" in out
    assert "STRATEGY-BUILT" not in out
  finally:
    for proc in list(procs.values()) + [timed]:
      if proc.poll() is None:
        proc.kill()
