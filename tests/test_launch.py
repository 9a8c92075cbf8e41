"""Tests of tfdp-launch with real processes: TF_CONFIG, output prefixes, failures, signals."""

import json
import os
import signal
import subprocess
import sys
import time

from tfdp import launch
from tests.conftest import REPO

PY = sys.executable


def _launch(args, **kw):
  return subprocess.run([PY, "-m", "tfdp.launch"] + args, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, cwd=REPO, timeout=60, check=False, **kw)


def test_each_worker_gets_its_own_tf_config_and_prefixed_output():
  proc = _launch(["--num_workers=3", "--", PY, "-c",
                  "import os; print(os.environ['TF_CONFIG'])"])
  assert proc.returncode == 0
  lines = proc.stdout.decode().splitlines()
  configs = {}
  for line in lines:
    prefix, _, body = line.partition("] ")
    configs[int(prefix.split()[-1])] = json.loads(body)
  assert sorted(configs) == [0, 1, 2]
  clusters = {json.dumps(c["cluster"]) for c in configs.values()}
  assert len(clusters) == 1
  addresses = configs[0]["cluster"]["worker"]
  assert len(set(addresses)) == 3
  for i, c in configs.items():
    assert c["task"] == {"type": "worker", "index": i}


def test_a_failing_worker_stops_the_others_and_is_named():
  script = ("import os, sys, time\n"
            "if os.environ['TFDP_WORKER_INDEX'] == '1':\n"
            "  time.sleep(0.5); sys.exit(7)\n"
            "time.sleep(120)\n")
  start = time.monotonic()
  proc = _launch(["--num_workers=2", "--", PY, "-c", script])
  assert time.monotonic() - start < 30
  out = proc.stdout.decode()
  assert proc.returncode == launch.EXIT_WORKER_FAILED
  assert "worker 1 exited with code 7" in out


def test_a_killed_worker_is_reported_with_its_signal():
  script = ("import os, signal, time\n"
            "if os.environ['TFDP_WORKER_INDEX'] == '0':\n"
            "  os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(120)\n")
  proc = _launch(["--num_workers=2", "--", PY, "-c", script])
  assert proc.returncode != 0
  assert "worker 0 was killed by SIGKILL" in proc.stdout.decode()


def test_sigterm_is_forwarded_to_every_worker():
  script = ("import os, signal, sys, time\n"
            "def bye(*_):\n"
            "  print('got SIGTERM', flush=True); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
  proc = subprocess.Popen([PY, "-m", "tfdp.launch", "--num_workers=2", "--", PY, "-c", script],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
  ready = 0
  while ready < 2:
    line = proc.stdout.readline().decode()
    assert line, "launcher ended early"
    ready += "ready" in line
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  out = out.decode()
  assert out.count("got SIGTERM") == 2, out
  assert proc.returncode == 0


def test_usage_errors():
  proc = _launch(["--num_workers=2"])
  assert proc.returncode == 2 and b"no COMMAND" in proc.stdout
  proc = _launch(["--num_workers=0", "--", PY, "-c", "pass"])
  assert proc.returncode == 2 and b"must be >= 1" in proc.stdout
  proc = _launch(["--num_workers=1", "--", "/nonexistent/binary"])
  assert proc.returncode == 2 and b"Cannot start worker 0" in proc.stdout
  assert b"Traceback" not in proc.stdout


def test_fixed_port_gives_consecutive_ports():
  spec = launch.cluster_spec(3, port=23456)
  assert spec == {"worker": ["localhost:23456", "localhost:23457", "localhost:23458"]}
  assert len(set(launch.free_ports(4))) == 4
