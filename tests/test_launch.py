"""Tests of tfdp-launch with real processes: TF_CONFIG, output, failures, signals, restarts, hangs, elastic slots, no TF."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tfdp import errors
from tfdp import launch
from tests.conftest import REPO, WORKERS
from tests import shared
from tests.shared import shared_run

PY = sys.executable
FAKE = os.path.join(WORKERS, "ft_fake.py")


def _run_cli(argv, capsys):
  """Runs `tfdp-launch ARGV` in this process; returns (exit code, stdout + stderr)."""
  with pytest.raises(SystemExit) as exit_info:
    launch.run(argv)
  captured = capsys.readouterr()
  return exit_info.value.code, captured.out + captured.err


def _fake(tmp_path, script, num_workers=2, **kw):
  """Runs the fake worker under launch(); returns (code, output, runs by attempt)."""
  out = io.StringIO()
  code = launch.launch([PY, FAKE, str(tmp_path), script], num_workers, out=out,
                       grace_seconds=5, **kw)
  runs = {}
  path = tmp_path / "runs.jsonl"
  for line in (path.read_text().splitlines() if path.exists() else []):
    r = json.loads(line)
    runs.setdefault(r["attempt"], []).append(r)
  return code, out.getvalue(), runs


def test_each_worker_gets_its_own_tf_config_and_prefixed_output(capsys):
  code, out = _run_cli(["--num_workers=3", "--", PY, "-c",
                        "import os; print(os.environ['TF_CONFIG'])"], capsys)
  assert code == 0
  configs = {}
  for line in out.splitlines():
    prefix, _, body = line.partition("] ")
    configs[int(prefix.split()[-1])] = json.loads(body)
  assert sorted(configs) == [0, 1, 2]
  clusters = {json.dumps(c["cluster"]) for c in configs.values()}
  assert len(clusters) == 1
  addresses = configs[0]["cluster"]["worker"]
  assert len(set(addresses)) == 3
  for i, c in configs.items():
    assert c["task"] == {"type": "worker", "index": i}


def test_a_failing_worker_stops_the_others_and_is_named(capsys):
  script = ("import os, sys, time\n"
            "if os.environ['TFDP_WORKER_INDEX'] == '1':\n"
            "  time.sleep(0.5); sys.exit(7)\n"
            "time.sleep(120)\n")
  start = time.monotonic()
  code, out = _run_cli(["--num_workers=2", "--", PY, "-c", script], capsys)
  assert time.monotonic() - start < 30
  assert code == launch.EXIT_WORKER_FAILED
  assert "worker 1 exited with code 7" in out


def test_a_killed_worker_is_reported_with_its_signal(capsys):
  script = ("import os, signal, time\n"
            "if os.environ['TFDP_WORKER_INDEX'] == '0':\n"
            "  os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(120)\n")
  code, out = _run_cli(["--num_workers=2", "--", PY, "-c", script], capsys)
  assert code == launch.EXIT_WORKER_FAILED
  assert "worker 0 was killed by SIGKILL" in out


def _signal_when(out, needle, count, sig):
  def watch():
    deadline = time.monotonic() + 60
    while out.getvalue().count(needle) < count and time.monotonic() < deadline:
      time.sleep(0.05)
    os.kill(os.getpid(), sig)
  t = threading.Thread(target=watch, daemon=True)
  t.start()
  return t


@pytest.mark.parametrize("exit_code", [0, 75])
def test_sigterm_is_forwarded_to_every_worker(exit_code):
  # 0: workers stop cleanly; 75: they saved and ask for a resume (preemption).
  script = ("import os, signal, sys, time\n"
            "def bye(*_):\n"
            f"  print('got SIGTERM', flush=True); sys.exit({exit_code})\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', os.environ['TFDP_WORKER_INDEX'], flush=True)\n"
            "time.sleep(120)\n")
  out = io.StringIO()
  _signal_when(out, "ready", 2, signal.SIGTERM)
  code = launch.launch([PY, "-c", script], 2, out=out, grace_seconds=10,
                       max_restarts=3)
  log = out.getvalue()
  assert log.count("got SIGTERM") == 2, log
  assert code == exit_code, log
  assert "restart" not in log.replace("no more restarts", ""), log
  if exit_code == launch.EXIT_PREEMPTED:
    assert "run the same command again to resume" in log


def test_usage_errors(capsys):
  code, out = _run_cli(["--num_workers=2"], capsys)
  assert code == 2 and "no COMMAND" in out
  code, out = _run_cli(["--num_workers=0", "--", PY, "-c", "pass"], capsys)
  assert code == 2 and "must be >= 1" in out
  code, out = _run_cli(["--num_workers=1", "--", "/nonexistent/binary"], capsys)
  assert code == 2 and "Cannot start worker 0" in out
  assert "Traceback" not in out
  code, out = _run_cli(["--max_restarts=-1", "--", PY], capsys)
  assert code == 2 and "--max_restarts must be >= 0" in out
  code, out = _run_cli(["--elastic", "--num_workers=2", "--min_workers=3", "--", PY], capsys)
  assert code == 2 and "--min_workers must be in [1, 2]" in out
  code, out = _run_cli(["--hosts=a,b,c", "--num_workers=2", "--", PY], capsys)
  assert code == 2 and "names 3 hosts" in out


def test_fixed_port_gives_consecutive_ports():
  spec = launch.cluster_spec(3, port=23456)
  assert spec == {"worker": ["localhost:23456", "localhost:23457", "localhost:23458"]}
  assert len(set(launch.free_ports(4))) == 4
  spec = launch.cluster_spec(2, port=7000, hosts=["10.0.0.1", "10.0.0.2"])
  assert spec == {"worker": ["10.0.0.1:7000", "10.0.0.2:7001"]}


def test_restarts_after_failures_with_fresh_ports_and_the_restart_count(tmp_path):
  code, out, runs = _fake(tmp_path, "0:1:exit=7;1:0:exit=3", max_restarts=2)
  assert code == 0, out
  assert sorted(runs) == [0, 1, 2]
  assert "restart 1/2: worker 1 exited with code 7" in out
  assert "restart 2/2: worker 0 exited with code 3" in out
  assert "job finished after 2 restart(s)" in out
  addresses = [tuple(runs[a][0]["tf_config"]["cluster"]["worker"]) for a in runs]
  assert len(set(addresses)) == 3, addresses  # new ports at every attempt


def test_gives_up_after_max_restarts_with_a_summary_of_causes(tmp_path):
  code, out, runs = _fake(tmp_path, "0:1:exit=4;1:0:exit=9", max_restarts=1)
  assert code == launch.EXIT_WORKER_FAILED
  assert sorted(runs) == [0, 1]
  assert ("giving up after 1 restart(s) (--max_restarts=1); causes: attempt 1: "
          "worker 1 exited with code 4; attempt 2: worker 0 exited with code 9; exit code 1.") in out, out


def test_the_worker_that_died_is_blamed_not_the_peer_that_lost_it():
  # Workers that end in the same poll: a death by a signal, then another
  # non-zero exit, before the consequences (lost peer, preempted).
  ended = [(0, launch.EXIT_PEER_LOST), (1, 3), (2, launch.EXIT_PREEMPTED)]
  assert launch.first_failure(ended) == (1, 3)
  assert launch.first_failure(ended + [(3, -signal.SIGKILL)]) == (3, -signal.SIGKILL)
  assert launch.first_failure([(1, 75), (0, 75)]) == (0, 75)


def test_a_hung_worker_is_detected_by_its_heartbeat_and_restarted(tmp_path):
  start = time.monotonic()
  code, out, runs = _fake(tmp_path, "0:1:hang", max_restarts=1, hang_timeout=1.5)
  assert code == 0, out
  assert "restart 1/1: worker 1 made no progress for 1.5 s (last heartbeat at step 4)" in out
  assert sorted(runs) == [0, 1]
  assert time.monotonic() - start < 20


def test_a_worker_that_never_beats_fails_the_startup_timeout(tmp_path):
  code, out, _ = _fake(tmp_path, "0:0:silent", max_restarts=1, hang_timeout=5,
                       startup_timeout=1.5)
  assert code == 0, out
  assert "worker 0 wrote no heartbeat within 1.5 s of its start" in out


def test_a_preempted_worker_is_a_restartable_event(tmp_path):
  code, out, runs = _fake(tmp_path, "0:0:exit=75", max_restarts=1)
  assert code == 0, out
  assert "restart 1/1: worker 0 was preempted (exit code 75)" in out
  assert sorted(runs) == [0, 1]


def test_elastic_leaves_out_a_slot_that_keeps_failing_and_takes_it_back(tmp_path):
  broken = tmp_path / "slot1-broken"
  broken.write_text("")
  # Slot 1 fails while `broken` exists; slot 0 repairs it in the 1-worker attempt.
  script = f"2:0:rm={broken};3:*:ok;*:1:exit=7"
  code, out, runs = _fake(tmp_path, script, max_restarts=4, elastic=True,
                          min_workers=1, slot_check=f"test ! -e {broken}")
  assert code == 0, out
  sizes = [len(runs[a]) for a in sorted(runs)]
  assert sizes == [2, 2, 1, 2], (sizes, out)
  alone = runs[2][0]
  assert alone["slot"] == 0 and alone["num_workers"] == 1
  assert len(alone["tf_config"]["cluster"]["worker"]) == 1
  assert "slot 1 failed 2 attempts in a row; leaving it out (1 workers)." in out
  assert "slot 1 is back; using 2 workers." in out


def test_elastic_never_goes_below_min_workers(tmp_path):
  code, out, runs = _fake(tmp_path, "*:1:exit=7", max_restarts=2, elastic=True,
                          min_workers=2)
  assert code == launch.EXIT_WORKER_FAILED
  assert [len(runs[a]) for a in sorted(runs)] == [2, 2, 2]
  assert "leaving it out" not in out


def test_elastic_renumbers_tasks_so_a_left_out_chief_slot_is_replaced(tmp_path):
  code, out, runs = _fake(tmp_path, "0:0:exit=7;1:0:exit=7;3:*:exit=0;2:1:exit=6",
                          num_workers=3, max_restarts=3, elastic=True, min_workers=2)
  assert code == 0, out
  assert [len(runs[a]) for a in sorted(runs)] == [3, 3, 2, 3]
  assert sorted((r["slot"], r["index"]) for r in runs[2]) == [(1, 0), (2, 1)]


def test_hosts_and_wrapper_place_each_worker(tmp_path):
  code, out, runs = _fake(tmp_path, "", hosts=["127.0.0.1", "127.0.0.2"],
                          wrapper=["env", "FT_WRAPPED=slot{slot}-{host}"])
  assert code == 0, out
  by_slot = {r["slot"]: r for r in runs[0]}
  assert by_slot[1]["argv0"] == "slot1-127.0.0.2"
  assert by_slot[0]["tf_config"]["cluster"]["worker"][1].startswith("127.0.0.2:")


def test_exit_codes_match_the_workers_modules():
  from tfdp.liveness import heartbeat  # pylint: disable=g-import-not-at-top
  from tfdp import preemption  # pylint: disable=g-import-not-at-top
  assert launch.EXIT_PREEMPTED == preemption.EXIT_PREEMPTED
  assert launch.EXIT_PEER_LOST == heartbeat.EXIT_PEER_LOST
  from tfdp.liveness import stall  # pylint: disable=g-import-not-at-top
  assert launch.EXIT_COLLECTIVE_TIMEOUT == stall.EXIT_COLLECTIVE_TIMEOUT
  assert launch.ENV_HEARTBEAT_FILE == heartbeat.ENV_HEARTBEAT_FILE


# --- The signal contract and the launcher's own process (real `tfdp-launch` processes) ---


class _Cli:
  """`python -m tfdp.launch ARGS` in its own session (as from a terminal), its output collected."""

  def __init__(self, args, cwd=REPO):
    self.proc = subprocess.Popen(
        [PY, "-m", "tfdp.launch"] + list(args), cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for raw in iter(self.proc.stdout.readline, b""):
      self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))

  def wait_for(self, needle, count, timeout=60):
    """The lines holding `needle`, once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
      found = [l for l in self.lines if needle in l]
      if len(found) >= count:
        return found
      assert self.proc.poll() is None, self.text()
      assert time.monotonic() < deadline, self.text()
      time.sleep(0.02)

  def text(self):
    self._reader.join(timeout=5 if self.proc.poll() is not None else 0)
    return "\n".join(self.lines)

  def close(self):
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()


def _alive(pid):
  """True while `pid` runs (a zombie nobody reaped yet counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _pids(lines):
  return [int(p) for l in lines for p in l.split("pids ")[1].split()]


def _gone_within(pids, seconds):
  deadline = time.monotonic() + seconds
  while any(map(_alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [p for p in pids if _alive(p)]


# Each worker starts a child of its own (`sleep`, which keeps the worker's
# output pipe open), prints both pids, then waits for a signal.
_WORKER_WITH_CHILD = (
    "import os, signal, subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '120'])\n"
    "{setup}\n"
    "print('pids', os.getpid(), child.pid, flush=True)\n"
    "time.sleep(120)\n")


def test_sigkill_follows_after_grace_seconds_when_workers_ignore_the_signal():
  script = _WORKER_WITH_CHILD.format(
      setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
  cli = _Cli(["--num_workers=2", "--grace_seconds=3", "--", PY, "-c", script])
  try:
    pids = _pids(cli.wait_for("pids", 2))
    os.kill(cli.proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = cli.proc.wait(timeout=60)
    took = time.monotonic() - signalled
  finally:
    cli.close()
  out = cli.text()
  assert code == launch.EXIT_WORKER_FAILED, out
  assert took <= 3 + 2, (took, out)
  assert "still running 3 s after SIGTERM; sending SIGKILL" in out, out
  assert not _gone_within(pids, 5), out


def test_after_a_ctrl_c_in_which_workers_saved_it_exits_75_at_once(tmp_path):
  # The workers "save" for 0.5 s, note when they exit, and exit 75; their
  # children still hold the output pipe, which must not keep the launcher.
  setup = ("def saved(*_):\n"
           "  time.sleep(0.5)\n"
           f"  path = os.path.join({str(tmp_path)!r}, os.environ['TFDP_WORKER_INDEX'])\n"
           "  open(path, 'w').write(repr(time.time()))\n"
           "  os._exit(75)\n"
           "signal.signal(signal.SIGINT, saved)")
  cli = _Cli(["--num_workers=2", "--", PY, "-c", _WORKER_WITH_CHILD.format(setup=setup)])
  try:
    pids = _pids(cli.wait_for("pids", 2))
    os.killpg(cli.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code = cli.proc.wait(timeout=60)
    ended = time.time()
  finally:
    cli.close()
  out = cli.text()
  assert code == launch.EXIT_PREEMPTED, out
  assert "run the same command again to resume" in out
  last_worker = max(float((tmp_path / str(i)).read_text()) for i in range(2))
  assert ended - last_worker < 2.0, (ended - last_worker, out)
  assert not _gone_within(pids, 5), out  # the workers' children too


@pytest.mark.parametrize("target", ["process_group", "pid"])
def test_workers_never_outlive_a_sigkilled_launcher(target):
  cli = _Cli(["--num_workers=2", "--", PY, "-c",
              "import os, time; print('pids', os.getpid(), flush=True); time.sleep(120)"])
  try:
    pids = _pids(cli.wait_for("pids", 2))
    if target == "process_group":
      os.killpg(os.getpgid(cli.proc.pid), signal.SIGKILL)  # kill -9 -- -PGID
    else:
      os.kill(cli.proc.pid, signal.SIGKILL)  # kill -9 PID
    cli.proc.wait(timeout=30)
  finally:
    cli.close()
  assert not _gone_within(pids, 5), cli.text()


def _entry_point():
  """The `tfdp-launch` console script as setup.cfg declares it: (module, function)."""
  with open(os.path.join(REPO, "setup.cfg"), encoding="utf-8") as f:
    target = re.search(r"^\s*tfdp-launch\s*=\s*(\S+)", f.read(), re.M).group(1)
  module, _, function = target.partition(":")
  return module, function


def test_the_launcher_process_never_imports_tensorflow():
  # What the console script does, then `python -m tfdp.launch`; each runs
  # `--num_workers=1 -- true` and looks at its own sys.modules at exit.
  module, function = _entry_point()
  check = ("import importlib, runpy, sys\n"
           "def run(fn):\n"
           "  try:\n"
           "    fn()\n"
           "  except SystemExit as e:\n"
           "    assert e.code == 0, e.code\n"
           "  heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
           "  assert not heavy, heavy[:5]\n"
           "sys.argv = ['tfdp-launch', '--num_workers=1', '--', 'true']\n"
           f"run(getattr(importlib.import_module({module!r}), {function!r}))\n"
           "run(lambda: runpy.run_module('tfdp.launch', run_name='__main__', alter_sys=True))\n"
           "print('ok', flush=True)\n")
  proc = subprocess.run([PY, "-c", check], cwd=REPO, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, timeout=120, check=False)
  out = proc.stdout.decode()
  assert proc.returncode == 0 and out.splitlines()[-1] == "ok", out


# How `import tfdp` and its submodules treat TensorFlow and tfdp.compat: each
# case runs in a fresh interpreter and reports (TF loaded, fixes applied).
_IMPORTS = {
    "import tfdp.launch": False,
    "import tfdp; tfdp.errors; from tfdp import errors, launch; import tfdp.launch.procs": False,
    "from tfdp.cli import ckpt": False,
    "import tfdp; tfdp.make_strategy": True,
    "from tfdp import callbacks": True,
    "import tfdp.callbacks": True,
    "from tfdp.checkpoint import CheckpointManager": True,
    "import keras; import tfdp": True,
}


@shared_run("import_runs")
def import_runs(root):
  """Each _IMPORTS case in a fresh interpreter, all at once: {case: [code, output]}."""
  del root
  report = ("\nimport json, sys\n"
            "compat = sys.modules.get('tfdp.compat')\n"
            "print(json.dumps(['tensorflow' in sys.modules, compat is not None and "
            "compat.applied() == set(compat.fixes())]))\n")
  env = shared.environ()
  env.pop("TFDP_COMPAT_DISABLE", None)
  procs = {case: subprocess.Popen([PY, "-c", case + report], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for case in _IMPORTS}
  results = {}
  for case, proc in procs.items():
    out = proc.communicate(timeout=300)[0].decode()
    results[case] = [proc.returncode, out]
  return results


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_IMPORTS))
def test_tfdp_is_lazy_and_applies_compat_before_it_is_used(import_runs, case):
  code, out = import_runs[case]
  assert code == 0, out[-3000:]
  uses_tf = _IMPORTS[case]
  assert json.loads(out.splitlines()[-1]) == [uses_tf, uses_tf], out[-3000:]


def test_options_are_one_dataclass_with_keyword_overrides():
  options = launch.LaunchOptions(max_restarts=2, grace_seconds=7)
  with pytest.raises(TypeError):
    launch.launch([PY, "-c", "pass"], 1, options=options, no_such_option=1)
  with pytest.raises(errors.ConfigError, match="--hang_timeout must be >= 0"):
    launch.launch([PY, "-c", "pass"], 1, options=options, hang_timeout=-1)
  out = io.StringIO()
  assert launch.launch([PY, "-c", "pass"], 1, out=out, options=options,
                       max_restarts=0) == launch.EXIT_OK


def test_a_tf_config_found_in_the_environment_is_replaced_and_said_once():
  found = {"cluster": {"worker": ["elsewhere:1", "elsewhere:2"]},
           "task": {"type": "worker", "index": 1}}
  script = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['task']['index'])"
  for env, said in ((dict(os.environ, TF_CONFIG=json.dumps(found)), 1),
                    ({k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, 0)):
    out = io.StringIO()
    assert launch.launch([PY, "-c", script], 2, env=env, out=out) == 0
    lines = out.getvalue().splitlines()
    assert [l for l in lines if "TF_CONFIG" in l] == [
        "[tfdp-launch] TF_CONFIG is set in the environment; each of the 2 workers gets its own "
        "instead (unset it to silence this)."] * said, lines
    assert sorted(l for l in lines if l.startswith("[worker")) == ["[worker 0] 0", "[worker 1] 1"]
