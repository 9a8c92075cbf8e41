"""Real multi-host run: one worker per Linux network namespace joined by veth; a kill and a link cut mid-training."""

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tfdp import launch
from tests.workers import ft_common

pytestmark = pytest.mark.slow

# A private range that exists only inside the test's namespaces.
SUBNET = "10.213.0"


def _ip(*args, check=True):
  return subprocess.run(["ip"] + list(args), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, check=check, timeout=30)


def _cannot_build():
  """Why this host cannot build network namespaces, or None."""
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  if os.geteuid() != 0:
    return "building network namespaces needs root"
  if shutil.which("ip") is None:
    return "the `ip` command (iproute2) is missing: apt-get install -y iproute2"
  return None


@pytest.fixture
def two_hosts():
  """Two namespaces tfdpNNNN-0 and -1 with SUBNET.1 and SUBNET.2 on a veth link; always removed."""
  reason = _cannot_build()
  if reason:
    pytest.skip(reason)
  tag = f"tfdp{os.getpid() % 100000}"
  names = [f"{tag}-0", f"{tag}-1"]
  links = [f"{tag}a", f"{tag}b"]
  made = []
  try:
    for n in names:
      proc = _ip("netns", "add", n, check=False)
      if proc.returncode:
        pytest.skip(f"cannot create a network namespace: {proc.stdout.decode().strip()}")
      made.append(n)
      _ip("-n", n, "link", "set", "lo", "up")
    _ip("link", "add", links[0], "netns", names[0], "type", "veth", "peer", "name",
        links[1], "netns", names[1])
    for i, (n, l) in enumerate(zip(names, links)):
      _ip("-n", n, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", l)
      _ip("-n", n, "link", "set", l, "up")
    yield {"names": names, "links": links,
           "hosts": [f"{SUBNET}.1", f"{SUBNET}.2"],
           "wrapper": ["ip", "netns", "exec", f"{tag}-{{slot}}"]}
  finally:
    for n in made:
      pids = _ip("netns", "pids", n, check=False).stdout.decode().split()
      for pid in pids:
        try:
          os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
          pass
      _ip("netns", "del", n, check=False)  # Also removes the veth pair.


def _wait_for(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.1)


@pytest.mark.usefixtures("ft_reference")  # made early (tests/shared.py)
def test_kill_and_link_cut_across_namespaces_end_bitwise_equal(two_hosts, tmp_path,
                                                               tmp_path_factory):
  reference = ft_common.reference(tmp_path_factory)
  model_dir = str(tmp_path / "model")
  # Attempt 0: worker 1 (in the second namespace) is SIGKILLed at step 25.
  # Attempt 1: the link goes down once step 60 is checkpointed; up again
  # when the launcher restarts the group (ft_common.TEST_STEPS: 100 steps).
  plan = {"0": {"worker": 1, "step": 25}}
  out = io.StringIO()
  events = []

  def cut_the_link():
    try:
      _wait_for(lambda: "restart 1/" in out.getvalue(), 240, "the first restart")
      _wait_for(lambda: any(f.startswith("ckpt-60.") for f in os.listdir(model_dir)),
                240, "step 60")
      _ip("-n", two_hosts["names"][0], "link", "set", two_hosts["links"][0], "down")
      events.append(("down", time.monotonic()))
      _wait_for(lambda: "restart 2/" in out.getvalue(), 120, "the second restart")
      events.append(("restart", time.monotonic()))
    finally:
      _ip("-n", two_hosts["names"][0], "link", "set", two_hosts["links"][0], "up",
          check=False)

  cutter = threading.Thread(target=cut_the_link, daemon=True)
  cutter.start()
  code = launch.launch(
      ft_common.command(model_dir, ft_common.TEST_FLAGS), 2,
      env=ft_common.env(FT_CHAOS_PLAN=json.dumps(plan)),
      out=out, grace_seconds=5, max_restarts=2, hang_timeout=30,
      hosts=two_hosts["hosts"], wrapper=two_hosts["wrapper"])
  cutter.join(timeout=10)
  text = out.getvalue()
  (tmp_path / "log.txt").write_text(text)
  assert code == 0, text[-5000:]
  assert f"{SUBNET}.2:" in text  # the restarts name the namespaced addresses
  restarts = [l for l in text.splitlines() if "[tfdp-launch] restart " in l]
  assert len(restarts) == 2, restarts
  assert "worker 1 was killed by SIGKILL" in restarts[0]
  assert [e for e, _ in events] == ["down", "restart"], events
  # The cut is noticed by the workers (a lost peer) or by the launcher (no
  # heartbeat), within the survivors' bound or the hang timeout.
  assert "lost a peer" in restarts[1] or "made no progress" in restarts[1], restarts
  assert events[1][1] - events[0][1] < 30 + 5
  diffs = ft_common.differences(ft_common.final_weights(reference),
                                ft_common.final_weights(model_dir))
  assert not diffs, f"weights differ from the uninterrupted run: {diffs}"
  _, problems = ft_common.verify_all(model_dir)
  assert not problems, problems
