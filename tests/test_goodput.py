"""Tests of goodput accounting: summarize's arithmetic, the Recorder's ledger, TensorBoard, tfdp-launch over restarts, reruns."""

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from tfdp import goodput
from tfdp import launch
from tests.conftest import WORKERS

_ENV = (goodput.ENV_FILE, goodput.ENV_ATTEMPT_START, goodput.ENV_HIGH_WATER,
        goodput.ENV_HISTORY, goodput.ENV_RESTART_COUNT)


def _record(**fields):
  record = {"first_step_time": 1.0, "startup_seconds": 0.0, "productive_seconds": 0.0,
            "recomputed_steps": 0, "recomputed_seconds": 0.0, "blocked_seconds": {},
            "restore_seconds": 0.0, "directory": "/md"}
  record.update(fields)
  return record


def _two_restarts():
  return [
      # Failed at 160 after 52 s accounted: 8 s lost, 5 s until the next spawn.
      {"attempt": 0, "spawn": 100.0, "end": 160.0, "failed": True,
       "heartbeat_steps": [50, 49],
       "record": _record(startup_seconds=10, productive_seconds=40, last_step=48,
                         blocked_seconds={"persistent": 2.0})},
      # Failed at 200 after 29 s accounted: 6 s lost, 2 s until the next spawn.
      {"attempt": 1, "spawn": 165.0, "end": 200.0, "failed": True,
       "heartbeat_steps": [70, None],
       "record": _record(startup_seconds=8, restore_seconds=3, recomputed_steps=20,
                         recomputed_seconds=4, productive_seconds=15, last_step=70,
                         blocked_seconds={"local": 1.0, "persistent": 1.0})},
      # Succeeded at 300 after 91 s accounted: 7 s after its last step.
      {"attempt": 2, "spawn": 202.0, "end": 300.0, "failed": False,
       "heartbeat_steps": [],
       "record": _record(startup_seconds=6, restore_seconds=1, recomputed_steps=10,
                         recomputed_seconds=3, productive_seconds=80, last_step=100,
                         blocked_seconds={"local": 2.0}, finished=True, final_step=100)},
  ]


def test_summarize_two_restarts_adds_up_to_the_wall_time():
  s = goodput.summarize(_two_restarts(), end=301.0)
  assert s["wall_seconds"] == 201
  assert s["productive_seconds"] == 135
  assert s["percent"] == pytest.approx(100 * 135 / 201)
  assert (s["restarts"], s["restart_seconds"]) == (2, 8 + 5 + 6 + 2)
  assert (s["recomputed_steps"], s["recomputed_seconds"]) == (30, 7)
  assert s["blocked_seconds"] == {"local": 3.0, "persistent": 3.0}
  assert s["checkpoint_blocked_seconds"] == 6
  assert (s["startup_seconds"], s["restore_seconds"]) == (24, 4)
  assert s["other_seconds"] == 7 + 1  # after the last step, and after the last attempt
  parts = ("productive_seconds", "startup_seconds", "recomputed_seconds",
           "checkpoint_blocked_seconds", "restart_seconds", "other_seconds")
  assert sum(s[k] for k in parts) == pytest.approx(s["wall_seconds"])
  assert [a["lost_seconds"] for a in s["attempts"]] == [8, 6, 0]
  assert [a["gap_seconds"] for a in s["attempts"]] == [5, 2, 1]
  assert (s["finished"], s["final_step"], s["directory"]) == (True, 100, "/md")
  assert goodput.summary_line(s) == (
      "goodput 67.2%: 2 restarts (21 s), 30 steps recomputed (7.0 s), "
      "checkpoints blocked 6.0 s, start-up 24 s (restore 4.0 s), wall 201 s")
  json.dumps(s)  # goodput.json holds it as it is


def test_an_attempt_without_a_record_or_a_step_is_start_up():
  attempts = [
      {"attempt": 0, "spawn": 0.0, "end": 5.0, "failed": True, "heartbeat_steps": [None],
       "record": None},
      {"attempt": 1, "spawn": 6.0, "end": 20.0, "failed": True, "heartbeat_steps": [None],
       "record": _record(first_step_time=None, blocked_seconds={"local": 1.0})},
      {"attempt": 2, "spawn": 21.0, "end": 30.0, "failed": False, "heartbeat_steps": [],
       "record": _record(startup_seconds=4, productive_seconds=5)},
  ]
  s = goodput.summarize(attempts, end=30.0)
  assert [a["startup_seconds"] for a in s["attempts"]] == [5, 13, 4]
  assert (s["restarts"], s["restart_seconds"]) == (2, 2)
  assert s["percent"] == pytest.approx(100 * 5 / 30)
  assert goodput.summary_line(s).startswith("goodput 16.7%: 2 restarts (2.0 s), 0 steps")
  assert goodput.summary_line(dict(s, restarts=1)).startswith("goodput 16.7%: 1 restart (")


def test_high_water_is_the_highest_heartbeat_or_recorded_step():
  attempts = _two_restarts()
  assert goodput.high_water(attempts[:1]) == 50  # the heartbeat beats the stale record
  assert goodput.high_water(attempts[:2]) == 70
  assert goodput.high_water([{"heartbeat_steps": [None, -1], "record": None}]) is None


class _Clock:
  def __init__(self, t):
    self.t = t

  def __call__(self):
    return self.t


@pytest.fixture
def clock(monkeypatch):
  for name in _ENV:
    monkeypatch.delenv(name, raising=False)
  c = _Clock(1000.0)
  monkeypatch.setattr(goodput, "_now", c)
  return c


def test_recorder_splits_an_attempt_into_startup_recomputed_productive_and_blocked(
    tmp_path, monkeypatch, clock):
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "1000")
  monkeypatch.setenv(goodput.ENV_HIGH_WATER, "13")
  monkeypatch.setenv(goodput.ENV_RESTART_COUNT, "1")
  path = tmp_path / "attempt1.goodput.json"
  rec = goodput.Recorder(str(tmp_path), path=str(path), tensorboard=False)
  clock.t = 1003.0
  rec.restored(10, 2.0, "local")
  assert json.loads(path.read_text())["restored_step"] == 10
  for t, step, blocked in [(1005.0, 11, 0), (1006.0, 12, 0), (1007.5, 13, 0.5), (1008.0, 14, 0)]:
    clock.t = t - 0.01
    if blocked:
      rec.blocked(blocked, "local")
    clock.t = t
    rec.step(step)
  r = rec.record
  assert r["attempt"] == 1 and r["start"] == 1000.0
  assert (r["first_step"], r["startup_seconds"]) == (11, 5.0)  # restore and tracing
  assert (r["recomputed_steps"], r["recomputed_seconds"]) == (3, 1.0 + 1.0)
  assert (r["last_step"], r["steps"], r["productive_seconds"]) == (14, 4, 0.5)
  assert r["blocked_seconds"] == {"local": 0.5}
  clock.t = 1009.0
  summary = rec.finished(14)
  on_disk = json.loads(path.read_text())
  assert on_disk["finished"] and on_disk["final_step"] == 14
  assert summary["percent"] == pytest.approx(100 * 0.5 / 9)
  assert summary["other_seconds"] == 1.0
  # Not under tfdp-launch ($TFDP_GOODPUT_FILE unset): it writes goodput.json itself.
  assert (tmp_path / goodput.SUMMARY_FILE).exists()


def test_recorder_step_writes_at_most_twice_a_second_and_others_do_nothing(
    tmp_path, monkeypatch, clock):
  writes = []
  monkeypatch.setattr(goodput, "write_json_atomic", lambda p, o: writes.append(o["last_step"]))
  rec = goodput.Recorder(str(tmp_path), path=str(tmp_path / "r.json"), tensorboard=False)
  for step in range(1, 17):  # 8 steps a second for 2 s
    clock.t += 0.125
    rec.step(step)
  assert writes == [1, 5, 9, 13]
  other = goodput.Recorder(str(tmp_path), chief=False, path=str(tmp_path / "o.json"))
  other.restored(3, 1.0)
  other.step(4)
  other.blocked(1.0, "local")
  assert other.finished(4) is None
  assert writes == [1, 5, 9, 13] and not (tmp_path / "o.json").exists()


def test_without_the_launcher_finished_writes_goodput_json_and_scalars(tmp_path, clock):
  rec = goodput.Recorder(str(tmp_path))
  rec.start = clock.t = 1000.0
  rec.restored(None, 0.0)
  for step in (1, 2, 3):
    clock.t += 1.0
    rec.step(step)
  clock.t += 0.5
  rec.finished(3)
  s = json.loads((tmp_path / "goodput.json").read_text())
  assert (s["restarts"], s["wall_seconds"], s["productive_seconds"]) == (0, 3.5, 2.0)
  assert len(s["attempts"]) == 1 and s["attempts"][0]["finished"]
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  scalars = {}
  logdir = tmp_path / "logs" / "goodput"
  for name in os.listdir(logdir):
    for event in tf.compat.v1.train.summary_iterator(str(logdir / name)):
      for v in event.summary.value:
        scalars[v.tag] = (event.step, float(tf.make_ndarray(v.tensor)))
  assert set(scalars) == set(goodput.SCALARS)
  assert scalars["goodput/percent"] == (3, pytest.approx(100 * 2.0 / 3.5))
  assert scalars["goodput/startup_seconds"] == (3, 1.0)


def test_the_launcher_sums_a_restart_and_writes_goodput_json(tmp_path):
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  out = io.StringIO()
  env = {k: v for k, v in os.environ.items() if k not in _ENV}
  code = launch.launch([sys.executable, os.path.join(WORKERS, "goodput_fake.py"),
                        str(model_dir), "20", "13"], 2, max_restarts=1, out=out,
                       env=env, grace_seconds=5)
  text = out.getvalue()
  assert code == launch.EXIT_OK, text
  # The chief died at step 13 after saving step 10: steps 11..13 came again.
  lines = [l for l in text.splitlines() if l.startswith("[tfdp-launch] goodput ")]
  assert len(lines) == 1, text
  assert ": 1 restart (" in lines[0] and ", 3 steps recomputed (" in lines[0], lines[0]
  assert "done; tensorflow loaded: False" in text
  s = json.loads((model_dir / "goodput.json").read_text())
  assert (s["restarts"], s["recomputed_steps"], s["finished"], s["final_step"]) == (1, 3, True, 20)
  first, second = s["attempts"]
  # The chief's heartbeat said 13 (worker 1 may not have written one yet under load).
  assert first["failed"] and max(s for s in first["heartbeat_steps"] if s is not None) == 13
  assert first["has_record"] and first["blocked_seconds"]["persistent"] > 0
  assert (second["restored_step"], second["restored_tier"], second["first_step"]) == (
      10, "persistent", 11)
  assert first["gap_seconds"] > 0 and s["restart_seconds"] >= first["gap_seconds"]
  assert 0 < s["percent"] < 100
  parts = ("productive_seconds", "startup_seconds", "recomputed_seconds",
           "checkpoint_blocked_seconds", "restart_seconds", "other_seconds")
  assert sum(s[k] for k in parts) == pytest.approx(s["wall_seconds"])
  assert s["directory"] == str(model_dir)


def test_a_job_without_records_prints_no_goodput_line(tmp_path):
  out = io.StringIO()
  assert launch.launch([sys.executable, "-c", "pass"], 1, out=out) == launch.EXIT_OK
  assert "goodput" not in out.getvalue()


def _exact_attempts():
  return [
      # SIGKILLed at step 27: its heartbeats and record had seen step 5.
      {"attempt": 0, "spawn": 0.0, "end": 10.0, "failed": True, "heartbeat_steps": [5],
       "progress_steps": [27, 27], "record": _record(restored_step=None, last_step=5)},
      # Restored 20, killed at 40 (its record, written before, counted 3).
      {"attempt": 1, "spawn": 11.0, "end": 20.0, "failed": True, "heartbeat_steps": [],
       "progress_steps": [40, 39], "record": _record(restored_step=20, last_step=23,
                                                     recomputed_steps=3)},
      {"attempt": 2, "spawn": 21.0, "end": 30.0, "failed": False, "heartbeat_steps": [],
       "progress_steps": [60], "record": _record(restored_step=35, last_step=60,
                                                 finished=True, final_step=60)},
  ]


def test_progress_steps_make_recomputed_steps_exact():
  attempts = _exact_attempts()
  s = goodput.summarize(attempts, end=30.0)
  # 21..27 again, then 36..40 again: what was reached before, less what was restored.
  assert [a["recomputed_steps"] for a in s["attempts"]] == [0, 27 - 20, 40 - 35]
  assert s["recomputed_steps"] == 12
  assert [a["reached_step"] for a in s["attempts"]] == [27, 40, 60]
  assert s["attempts"][0]["progress_steps"] == [27, 27]
  assert goodput.high_water(attempts[:1]) == 27  # the step counters beat heartbeat and record
  assert goodput.high_water(attempts[:2]) == 40
  # Without progress files (an older launcher's attempts) the records' counts stand.
  old = [{k: v for k, v in a.items() if k != "progress_steps"} for a in attempts]
  assert goodput.summarize(old, end=30.0)["recomputed_steps"] == 3
  # A launcher's attempts win over the ledger's for the same spawn; ends are capped.
  merged = goodput.merge([dict(attempts[0], end=15.0), dict(attempts[1], failed=False)],
                         [attempts[1], attempts[2]])
  assert [(a["attempt"], a["spawn"], a["end"], a["failed"]) for a in merged] == [
      (0, 0.0, 11.0, True), (1, 11.0, 20.0, True), (2, 21.0, 30.0, False)]


def _steps(rec, clock, steps, seconds=0.01):
  for step in steps:
    clock.t += seconds
    rec.step(step)


def test_the_ledger_in_the_directory_counts_an_attempt_that_was_not_finished(
    tmp_path, monkeypatch, clock, capsys):
  # Attempt 0 reaches step 27 and is dropped (as by a SIGKILL): its record
  # was last written at its first step, its step counters hold 27.
  # Without the launcher each process starts its attempt: worker 1 before the chief.
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "999.5")
  worker1 = goodput.Recorder(str(tmp_path), chief=False)
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "1000")
  first = goodput.Recorder(str(tmp_path), tensorboard=False)
  first.restored(None, 0.0)
  for step in range(1, 28):
    clock.t += 0.01
    first.step(step)
    worker1.step(step)
  ledger = tmp_path / ".tfdp-goodput"
  assert len(list(ledger.glob("attempt-*.json"))) == 1
  assert len(list(ledger.glob("progress-*.bin"))) == 2
  assert json.loads(next(ledger.glob("attempt-*.json")).read_text())["last_step"] == 1
  # The same command again, without the launcher.
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "2000")
  clock.t = 2001.0
  second = goodput.Recorder(str(tmp_path), tensorboard=False)
  assert second.high_water == 27 and second.record["attempt"] == 1
  (earlier,) = second.earlier
  # It ended at its last step, which only the step counters saw.
  assert (earlier["spawn"], earlier["failed"]) == (1000.0, True)
  assert earlier["end"] == pytest.approx(1000.27)
  assert earlier["progress_steps"] == [27, 27]
  second.restored(20, 0.5, "persistent")
  _steps(second, clock, range(21, 41), seconds=1.0)
  assert second.record["recomputed_steps"] == 7
  summary = second.finished(40)
  assert (summary["restarts"], summary["recomputed_steps"], summary["final_step"]) == (1, 7, 40)
  assert json.loads((tmp_path / "goodput.json").read_text())["restarts"] == 1
  out = capsys.readouterr().out.splitlines()
  assert [l for l in out if "goodput" in l] == ["tfdp: " + goodput.summary_line(summary)]
  assert ": 1 restart (" in out[-1] and ", 7 steps recomputed (" in out[-1]
  # A run after a completed one is a new run: the old records and counters go.
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "3000")
  third = goodput.Recorder(str(tmp_path), tensorboard=False)
  assert third.earlier == [] and third.high_water is None
  assert sorted(p.name for p in ledger.iterdir()) == sorted([
      os.path.basename(third._ledger.record_path(3000.0)),  # pylint: disable=protected-access
      os.path.basename(third._progress.path)])  # pylint: disable=protected-access


def _fake(model_dir, *args):
  return [sys.executable, os.path.join(WORKERS, "goodput_fake.py"), str(model_dir)] + [
      str(a) for a in args]


def _clean_env():
  return {k: v for k, v in os.environ.items() if k not in _ENV}


def test_recomputed_steps_are_exact_with_fast_steps_under_the_launcher(tmp_path):
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  out = io.StringIO()
  # 5 ms steps, saves every 20, a heartbeat every 50 steps (4 a second): the
  # chief is SIGKILLed at step 77, which no heartbeat showed.
  code = launch.launch(_fake(model_dir, 100, 77, 0.005, 20, 50), 2, max_restarts=1,
                       out=out, env=_clean_env(), grace_seconds=5)
  text = out.getvalue()
  assert code == launch.EXIT_OK, text
  s = json.loads((model_dir / "goodput.json").read_text())
  first, second = s["attempts"]
  assert max(first["heartbeat_steps"]) == 50
  assert first["progress_steps"] == [77, 77] and first["reached_step"] == 77
  assert second["restored_step"] == 60
  assert (s["restarts"], s["recomputed_steps"], second["recomputed_steps"]) == (1, 17, 17)
  line = next(l for l in text.splitlines() if l.startswith("[tfdp-launch] goodput "))
  assert ": 1 restart (" in line and ", 17 steps recomputed (" in line, line
  assert "tfdp: goodput" not in text  # the chief leaves the line to the launcher


def test_a_second_launch_of_the_same_directory_is_a_restart(tmp_path):
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  out = io.StringIO()
  code = launch.launch(_fake(model_dir, 100, 77, 0.005, 20, 50), 2, out=out,
                       env=_clean_env(), grace_seconds=5)
  assert code == launch.EXIT_WORKER_FAILED, out.getvalue()
  out = io.StringIO()
  code = launch.launch(_fake(model_dir, 100, 77, 0.005, 20, 50), 2, out=out,
                       env=_clean_env(), grace_seconds=5)
  text = out.getvalue()
  assert code == launch.EXIT_OK, text
  line = next(l for l in text.splitlines() if l.startswith("[tfdp-launch] goodput "))
  assert ": 1 restart (" in line and ", 17 steps recomputed (" in line, line
  s = json.loads((model_dir / "goodput.json").read_text())
  first, second = s["attempts"]
  assert (first["failed"], first["reached_step"], first["has_record"]) == (True, 77, True)
  assert (second["restored_step"], second["finished"], s["final_step"]) == (60, True, 100)
  assert s["restarts"] == 1 and s["recomputed_steps"] == 17


def test_a_rerun_without_the_launcher_is_a_restart(tmp_path):
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  run = lambda: subprocess.run(_fake(model_dir, 40, 27, 0.005, 10, 1), env=_clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=60, check=False)
  killed = run()
  assert killed.returncode == -signal.SIGKILL, killed.stdout
  done = run()
  assert done.returncode == 0, done.stdout
  lines = [l for l in done.stdout.splitlines() if l.startswith("tfdp: goodput")]
  assert len(lines) == 1 and lines[0].startswith("tfdp: goodput "), done.stdout
  assert ": 1 restart (" in lines[0] and ", 7 steps recomputed (" in lines[0], lines[0]
  s = json.loads((model_dir / "goodput.json").read_text())
  first, second = s["attempts"]
  assert (first["failed"], first["reached_step"], first["progress_steps"]) == (True, 27, [27])
  assert first["end"] <= second["spawn"]
  assert (second["restored_step"], second["recomputed_steps"], s["finished"]) == (20, 7, True)
  parts = ("productive_seconds", "startup_seconds", "recomputed_seconds",
           "checkpoint_blocked_seconds", "restart_seconds", "other_seconds")
  assert sum(s[k] for k in parts) == pytest.approx(s["wall_seconds"])
  # Once more after it completed: a new run, of one attempt.
  again = run()
  assert again.returncode == 0 and ": 0 restarts (" in again.stdout, again.stdout


def test_the_goodput_line_comes_before_delete_checkpoint_removes_the_backups(tmp_path):
  backup_dir = tmp_path / "backup"
  cmd = [sys.executable, os.path.join(WORKERS, "goodput_keras.py"), str(backup_dir), "23"]
  env = dict(_clean_env(), TF_CPP_MIN_LOG_LEVEL="2")
  run = lambda: subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=240, check=False)
  killed = run()
  assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
  done = run()
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  assert "trained to step 40, restored 20" in done.stdout, done.stdout
  lines = [l for l in done.stdout.splitlines() if l.startswith("tfdp: goodput")]
  assert len(lines) == 1, done.stdout
  # Killed at step 23 after the backup of step 20: 21..23 came again.
  assert lines[0].startswith("tfdp: goodput ") and ": 1 restart (" in lines[0], lines[0]
  assert ", 3 steps recomputed (" in lines[0], lines[0]
  assert lines[0].endswith("[backup_dir exists: True, goodput.json exists: True]"), lines[0]
  assert not backup_dir.exists()  # delete_checkpoint=True, as Keras's default


def test_a_worker_of_the_asking_attempt_is_not_counted_in_an_earlier_one(tmp_path, monkeypatch,
                                                                          clock):
  """Under tfdp-launch every worker of an attempt has its start: worker 1 may step before the chief asks."""
  from tfdp.goodput import ledger  # pylint: disable=g-import-not-at-top
  pid = os.getpid()

  def worker(start):  # another process: its own progress file
    monkeypatch.setattr(ledger.os, "getpid", lambda: pid + 1)
    rec = goodput.Recorder(str(tmp_path), chief=False)
    monkeypatch.setattr(ledger.os, "getpid", lambda: pid)
    return rec

  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "1000")
  first = goodput.Recorder(str(tmp_path), tensorboard=False)
  worker1 = worker(1000)
  first.restored(None, 0.0)
  for step in range(1, 28):
    clock.t += 0.01
    first.step(step)
    worker1.step(step)
  # The next attempt: its worker 1 is at step 35 when its chief's recorder reads the ledger.
  monkeypatch.setenv(goodput.ENV_ATTEMPT_START, "2000")
  clock.t = 2000.5
  again = worker(2000)
  for step in range(21, 36):
    clock.t += 0.01
    again.step(step)
  second = goodput.Recorder(str(tmp_path), tensorboard=False)
  (earlier,) = second.earlier
  assert sorted(earlier["progress_steps"]) == [27, 27]
  assert second.high_water == 27


def test_the_ledger_makes_every_folder_it_creates_private(tmp_path):
  """A run directory the ledger makes first is the backups' folder too: 0700, not the umask's."""
  folder = tmp_path / "runs" / "model" / ".tfdp-goodput"
  from tfdp.goodput import ledger  # pylint: disable=g-import-not-at-top
  ledger.Ledger(str(folder))
  for path in (tmp_path / "runs", tmp_path / "runs" / "model", folder):
    assert os.stat(path).st_mode & 0o777 == 0o700, path

