"""Tests of how tfdp-launch ends a failed job (errors once, one last line per kind) and of the chief's live progress bar."""

import io
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tfdp import launch
from tfdp.launch import output
from tfdp.launch import worker_lines
from tfdp.launch import noise
from tests.conftest import REPO, WORKERS

PY = sys.executable
WORKER = os.path.join(WORKERS, "launch_worker.py")
FAKE = os.path.join(WORKERS, "ft_fake.py")
SHOW = f"--verbose_workers or {noise.ENV_SHOW_TF_LOGS}=1 shows them"


@pytest.fixture(autouse=True)
def _no_show_env(monkeypatch):
  monkeypatch.delenv(noise.ENV_SHOW_TF_LOGS, raising=False)


def _launch(mode, tmp_path, num_workers=2, out=None, **kw):
  """Runs launch_worker.py MODE as `num_workers` workers; returns (exit code, output lines)."""
  out = out if out is not None else io.StringIO()
  code = launch.launch([PY, WORKER, mode, str(tmp_path)], num_workers, out=out,
                       grace_seconds=5, **kw)
  return code, out.getvalue().splitlines()


def _final(lines):
  """The launcher's lines after `job failed`: the failure lines."""
  at = next(i for i, l in enumerate(lines) if l.startswith("[tfdp-launch] job failed"))
  return lines[at + 1:]


# --- Failures, with real worker processes ---


def test_the_same_error_on_every_worker_is_printed_once_and_ends_the_output(tmp_path):
  # A ConfigError would repeat in every attempt: no restart, exit 2 (a usage error).
  code, lines = _launch("same", tmp_path, max_restarts=2)
  assert code == launch.EXIT_USAGE, lines
  assert not any(l.startswith("[tfdp-launch] restart") for l in lines), lines
  assert ("[tfdp-launch] job failed on its settings or its backup; not restarting it; "
          "exit code 2.") in lines, lines
  text = "\n".join(lines)
  # Both workers' tracebacks differ in the worker index, pid and temp folder only.
  assert text.count("Traceback (most recent call last):") == 1, text
  block = [l for l in lines if l.startswith("[workers 0,1] ")]
  assert block[0] == "[workers 0,1] Traceback (most recent call last):", text
  assert re.fullmatch(r"\[workers 0,1\] tfdp\.errors\.ConfigError: --batch_size=33 is not a "
                      r"multiple of the 2 workers \(this is worker [01], pid \d+, scratch "
                      r"tmp\w{8}\)\.", block[-1]), text
  assert not any(l.startswith("[worker ") for l in lines), text
  final = _final(lines)
  assert len(final) == 1, text
  assert re.fullmatch(r"\[tfdp-launch\] workers 0,1 failed: ConfigError: --batch_size=33 is not "
                      r"a multiple of the 2 workers \(this is worker [01], .*\)\.", final[0]), text
  assert "held back" not in text  # no TF here: nothing to count


def test_different_errors_are_printed_each_and_end_with_one_line_per_kind(tmp_path):
  code, lines = _launch("different", tmp_path)
  assert code == launch.EXIT_WORKER_FAILED, lines
  text = "\n".join(lines)
  assert "[worker 0] Traceback (most recent call last):" in lines, text
  assert "[worker 1] Traceback (most recent call last):" in lines, text
  assert "[worker 0] ValueError: learning rate must be positive, got -0.1" in lines, text
  assert "[worker 1] KeyError: 'label'" in lines, text
  assert "[workers" not in text
  final = _final(lines)
  assert sorted(final) == [
      "[tfdp-launch] worker 0 failed: ValueError: learning rate must be positive, got -0.1",
      "[tfdp-launch] worker 1 failed: KeyError: 'label'"], text
  # The worker the launcher blames (the first to exit) comes last.
  blamed = re.search(r"worker (\d) exited with code 1; stopping", text).group(1)
  assert final[-1].startswith(f"[tfdp-launch] worker {blamed} failed: "), text


def test_a_worker_killed_by_a_signal_ends_with_the_signal(tmp_path):
  code, lines = _launch("signal", tmp_path)
  assert code == launch.EXIT_WORKER_FAILED, lines
  assert "[worker 0] about to be killed" in lines, lines
  assert "[tfdp-launch] worker 0 was killed by SIGKILL; stopping the other workers." in lines
  # Worker 1, stopped by the launcher, printed no error: it is no failure of its own.
  assert _final(lines) == ["[tfdp-launch] worker 0 failed: killed by SIGKILL"], lines


def test_a_peers_collective_error_after_a_kill_is_no_failure_of_its_own(tmp_path):
  """Worker 1's collectives abort because worker 0 died: the job failed of worker 0's kill, one line."""
  code, lines = _launch("peer", tmp_path)
  assert code == launch.EXIT_WORKER_FAILED, lines
  # Its traceback says nothing about the cause: counted, not printed.
  assert not any("UnavailableError" in l or "Traceback" in l for l in lines), lines
  assert ("[tfdp-launch] 3 lines of worker 1 after worker 0 failed held back (collectives "
          f"aborted without it); {SHOW}") in lines, lines
  assert _final(lines) == ["[tfdp-launch] worker 0 failed: killed by SIGKILL"], lines


def test_tf_noise_of_a_failed_job_is_one_count_line_not_the_last(tmp_path):
  code, lines = _launch("noise", tmp_path)
  assert code == launch.EXIT_USAGE, lines  # Its error is a ConfigError.
  text = "\n".join(lines)
  assert "cuInit" not in text and "cuda drivers" not in text and "AVX2" not in text, text
  count = f"[tfdp-launch] 10 TensorFlow log lines held back; {SHOW}"
  assert lines.count(count) == 1, text
  assert lines.index(count) < lines.index(
      "[tfdp-launch] job failed on its settings or its backup; not restarting it; exit code 2."), text
  assert re.fullmatch(r"\[tfdp-launch\] workers 0,1 failed: ConfigError: .*", lines[-1]), text


def test_a_worker_without_an_error_line_ends_with_its_exit_code(tmp_path):
  out = io.StringIO()
  code = launch.launch([PY, "-c", "import os, sys; print('no traceback here'); "
                        "sys.exit(int(os.environ['TFDP_WORKER_INDEX']) * 3)"], 2, out=out)
  lines = out.getvalue().splitlines()
  assert code == launch.EXIT_WORKER_FAILED, lines
  assert lines[-1] == "[tfdp-launch] worker 1 failed: exited with code 3", lines


def test_a_hung_worker_ends_with_what_its_heartbeat_said(tmp_path):
  out = io.StringIO()
  code = launch.launch([PY, FAKE, str(tmp_path), "0:1:hang"], 2, out=out, grace_seconds=5,
                       hang_timeout=1.5)
  lines = out.getvalue().splitlines()
  assert code == launch.EXIT_WORKER_FAILED, lines
  assert lines[-1] == ("[tfdp-launch] worker 1 failed: made no progress for 1.5 s "
                       "(last heartbeat at step 4)"), lines


def test_after_restarts_the_last_line_is_the_last_attempts_failure(tmp_path):
  out = io.StringIO()
  code = launch.launch([PY, FAKE, str(tmp_path), "0:1:exit=4;1:0:exit=9"], 2, out=out,
                       grace_seconds=5, max_restarts=1)
  lines = out.getvalue().splitlines()
  assert code == launch.EXIT_WORKER_FAILED, lines
  assert lines[-2].startswith("[tfdp-launch] giving up after 1 restart(s)"), lines
  assert lines[-1] == "[tfdp-launch] worker 0 failed: exited with code 9", lines


# --- What counts as the same, in WorkerLines ---


def _lines(num_workers=2, addresses=None):
  stream = io.StringIO()
  return worker_lines.WorkerLines(output.Output(stream), num_workers, addresses=addresses), stream


def test_same_text_ignores_only_what_differs_between_workers():
  same = worker_lines.same_text
  assert same("worker 0 of 2 at localhost:2000", 0, "localhost:2000") == same(
      "worker 1 of 2 at localhost:2001", 1, "localhost:2001")
  assert same("I0000 00:00:1796133538.349871   25316 f.cc:31] ready", 0) == same(
      "I0000 00:00:1796133539.000001   25317 f.cc:31] ready", 1)
  assert same("pid 1234 wrote /tmp/tmpab_d1234/x at 0x7f3a5c2b1e80", 0) == same(
      "pid 99 wrote /tmp/tmpzz9y8x7w/x at 0x7f3a5c2b9990", 1)
  assert same("/job:worker/replica:0/task:0 failed", 0) == same(
      "/job:worker/replica:0/task:1 failed", 1)
  # Other numbers, and the index of another worker, still tell errors apart.
  assert same("shape (3, 4)", 0) != same("shape (5, 6)", 1)
  assert same("lost worker 1", 0) != same("lost worker 0", 1)
  assert same("worker 1 of 2", 0) != same("worker 1 of 2", 1)
  assert same("W1201 14:02:15.351870 1402 f.py:2] a", 0) != same(
      "E1201 14:02:15.351870 1402 f.py:2] a", 1)


def test_blocks_that_differ_in_more_than_the_worker_are_printed_each():
  lines, stream = _lines()
  for index, shape in ((0, "(3, 4)"), (1, "(5, 6)")):
    lines.add(index, "Traceback (most recent call last):")
    lines.add(index, '  File "train.py", line 3, in <module>')
    lines.add(index, f"ValueError: worker {index}: bad shape {shape}")
  assert stream.getvalue() == ""  # held
  lines.finish([1, 1], failed=True)
  assert stream.getvalue().splitlines() == [
      "[worker 0] Traceback (most recent call last):",
      '[worker 0]   File "train.py", line 3, in <module>',
      "[worker 0] ValueError: worker 0: bad shape (3, 4)",
      "[worker 1] Traceback (most recent call last):",
      '[worker 1]   File "train.py", line 3, in <module>',
      "[worker 1] ValueError: worker 1: bad shape (5, 6)"]
  assert lines.error(0) == ("ValueError: worker 0: bad shape (3, 4)", None)


def test_a_block_is_released_in_time_and_a_later_copy_is_one_line():
  lines, stream = _lines(3)
  lines.add(0, "step 1")
  for index in (0, 1):
    lines.add(index, "usage: train [-h]")
    lines.add(index, f"train: error: worker {index}: no such flag")
  lines.tick(now=time.monotonic() + worker_lines.BLOCK_HOLD_SECONDS + 1)
  lines.add(2, "usage: train [-h]")
  lines.add(2, "train: error: worker 2: no such flag")
  lines.finish([2, 2, 2], failed=True)
  assert stream.getvalue().splitlines() == [
      "[worker 0] step 1",
      "[workers 0,1] usage: train [-h]",
      "[workers 0,1] train: error: worker 0: no such flag",
      "[worker 2] (the same 2 line(s) as workers 0,1's above)"]
  assert lines.error(2) == ("worker 2: no such flag", None)


def test_noise_is_counted_not_kept():
  lines, stream = _lines(1)
  for i in range(5):
    lines.add(0, "I0000 00:00:1796133538.349871   {} cudart_stub.cc:31] Could not find cuda "
              "drivers on your machine, GPU will not be used.".format(i))
  lines.finish([1], failed=True)
  assert stream.getvalue() == f"[tfdp-launch] 5 TensorFlow log lines held back; {SHOW}\n"
  lines, stream = _lines(1)
  lines.add(0, noise.NOISE[0].line.pattern.replace("\\", ""))
  lines.finish([0], failed=False)
  assert stream.getvalue() == ""


def test_error_lines_python_cli_and_absl_fatal():
  lines, _ = _lines(1)
  lines.add(0, "F0000 00:00:1796133538.349871   25316 check.cc:7] Check failed: x == y")
  for text in ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
               "    main()", "tensorflow.python.framework.errors_impl.NotFoundError: "
               "/data/x: No such file", "During handling of the above exception, another "
               "exception occurred:", "", "Traceback (most recent call last):",
               '  File "a.py", line 3, in <module>', "KeyboardInterrupt"]:
    lines.add(0, text)
  assert lines.error(0) == ("KeyboardInterrupt", "Check failed: x == y")
  lines.add(0, "tfdp-train: error: --train_steps must be >= 0, got -1.")
  assert lines.error(0)[0] == "--train_steps must be >= 0, got -1."


# --- The chief's progress bar ---


class _Timed(io.StringIO):
  """A stream that notes when each write came."""

  def __init__(self):
    super().__init__()
    self.writes = []

  def write(self, s):
    self.writes.append((time.time(), s))
    return super().write(s)


def test_the_chiefs_progress_bar_arrives_before_its_line_ends(tmp_path):
  out = _Timed()
  code, lines = _launch("bar", tmp_path, out=out)
  assert code == launch.EXIT_OK, lines
  text = out.getvalue()
  ended = float(re.search(r"\[worker 0\] 25/25 done at ([\d.]+)", text).group(1))
  # Redraws of worker 0's line, written while its line had not ended; a file gets
  # at most one a second (BAR_SECONDS_FILE), each the latest one.
  redraws = [(t, s) for t, s in out.writes if re.fullmatch(r"\r?\[worker 0\] \d+/25 \[[=.]+\]", s)]
  assert any(t < ended for t, _ in redraws), (ended, out.writes)
  assert 1 <= len(redraws) <= 4, redraws
  # Only the chief's bar: worker 1's line comes whole, as it ends.
  assert "\r[worker 1]" not in text and "[worker 1] 25/25 done at" in text, text
  assert re.search(r"^\[worker 1\] 25/25 done at [\d.]+$", text, re.M), text
  assert "[worker 0] worker 0 finished" in lines and "[worker 1] worker 1 finished" in lines


def test_a_single_worker_bar_through_the_cli_process(tmp_path):
  # The launcher's own process, its stdout a pipe: partial lines come before the newline.
  proc = subprocess.Popen([PY, "-m", "tfdp.launch", "--num_workers=1", "--", PY, WORKER, "bar",
                           str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE)
  chunks = []

  def read():
    while True:
      chunk = os.read(proc.stdout.fileno(), 1 << 16)
      if not chunk:
        return
      chunks.append((time.time(), chunk.decode()))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  assert proc.wait(timeout=60) == 0
  reader.join(timeout=10)
  text = "".join(c for _, c in chunks)
  ended = float(re.search(r"25/25 done at ([\d.]+)", text).group(1))
  early = [c for t, c in chunks if t < ended and "[worker 0] " in c and "/25 [" in c]
  assert early, chunks
  assert re.search(r"\r\[worker 0\] 25/25 done at [\d.]+\n", text), text


class _Tty(io.StringIO):
  def isatty(self):
    return True


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_other_lines_go_above_it():
  stream = _Tty()
  out = output.Output(stream)
  lines = worker_lines.WorkerLines(out, 2)
  t = 1000.0
  assert out.bar_seconds == output.BAR_SECONDS_TTY
  lines.partial(1, "1/9 [=........]")  # not the chief: line by line only
  out.bar(0, "[worker 0] 2/9 [==.......]", now=t)  # the first redraw waits for bar_seconds
  out.tick(now=t + 0.1)
  assert stream.getvalue() == ""
  out.bar(0, "[worker 0] 3/9 [===......]", now=t + 0.3)
  out.bar(0, "[worker 0] 4/9 [====.....]", now=t + 0.4)  # too soon: held, the latest kept
  out.bar(0, "[worker 0] 5/9 [=====....]", now=t + 0.45)
  out.tick(now=t + 0.6)
  lines.add(1, "a line of worker 1")
  lines.add(0, "9/9 [=========] done")
  out.log("done")
  assert stream.getvalue() == (
      "[worker 0] 3/9 [===......]"
      "\r\x1b[K[worker 0] 5/9 [=====....]"
      "\r\x1b[K[worker 1] a line of worker 1\n[worker 0] 5/9 [=====....]"
      "\r\x1b[K[worker 0] 9/9 [=========] done\n"
      "[tfdp-launch] done\n")


def test_in_a_file_a_line_of_another_worker_ends_the_bar_and_it_starts_anew():
  stream = io.StringIO()
  out = output.Output(stream)
  t = 1000.0
  out.bar(0, "[worker 0] 1/3", now=t)
  out.bar(0, "[worker 0] 2/3", now=t + 1)
  out.write_line("[worker 1] hello", 1)
  out.bar(0, "[worker 0] 3/3", now=t + 2)
  out.write_line("[worker 0] 3/3 done", 0)
  out.bar(0, "[worker 0] 1/3", now=t + 3)  # the next epoch's bar, not due yet
  out.write_line("[worker 0] 3/3 done", 0)
  out.bar(0, "[worker 0] 1/3", now=t + 4)
  out.bar(0, "[worker 0] 2/3", now=t + 5)
  out.end_bar(0, keep=True)  # the worker's output ended
  assert stream.getvalue() == (
      "[worker 0] 2/3\n[worker 1] hello\n"
      "[worker 0] 3/3\r[worker 0] 3/3 done\n"
      "[worker 0] 3/3 done\n"
      "[worker 0] 2/3\n")


def test_redraws_are_cut_to_the_text_after_the_last_carriage_return():
  lines, stream = _lines(2)
  pump_in = io.BytesIO("Epoch 1/2\n\b\b\r1/2 ━━\b\b\r2/2 ━━━━ loss: 0.5\nwhole line\r\n".encode())
  pump = worker_lines.Pump(pump_in, 0, lines)
  pump.run()
  assert stream.getvalue().splitlines() == [
      "[worker 0] Epoch 1/2", "[worker 0] 2/2 ━━━━ loss: 0.5", "[worker 0] whole line"]


def test_a_log_record_glued_to_a_redraw_is_a_line_of_its_own():
  # Keras's bar (stdout) has no newline when absl logs (stderr) on the same pipe.
  stream = io.StringIO()
  lines = worker_lines.WorkerLines(output.Output(stream, bar_seconds=0), 1)
  record = "I1201 23:22:29.166696 140516935244672 callbacks.py:12] saved ckpt-8"
  worker_lines.Pump(io.BytesIO(f"\r7/8 ━━ loss: 2.36{record}\n".encode()), 0, lines).run()
  assert stream.getvalue() == f"[worker 0] 7/8 ━━ loss: 2.36\r[worker 0] {record}\n"


def test_a_redraw_is_cut_to_the_terminal_width_not_counting_colour_codes(monkeypatch):
  monkeypatch.setenv("COLUMNS", "30")
  text = "\x1b[1m8/64\x1b[0m \x1b[32m" + "━" * 20 + "\x1b[0m 2s 45ms/step - loss: 0.1"
  fitted = output.Output._fit(text)  # pylint: disable=protected-access
  assert re.sub(r"\x1b\[[0-9;]*m", "", fitted) == "8/64 " + "━" * 20 + " 2s "
  assert fitted.startswith("\x1b[1m8/64\x1b[0m \x1b[32m") and fitted.endswith("\x1b[0m")


def test_a_failed_workers_lines_that_repeat_anothers_are_named_not_printed_again():
  lines, stream = _lines()
  lines.add(0, "worker 0: loading shard 0 of /tmp/tmpab12cd34/data")
  lines.add(1, "worker 1: loading shard 0 of /tmp/tmpzz98yy76/data")  # the same, for worker 1
  lines.add(0, "worker 0 is ready")
  lines.finish([0, 1], failed=True)
  assert stream.getvalue().splitlines() == [
      "[worker 0] worker 0: loading shard 0 of /tmp/tmpab12cd34/data",
      "[worker 0] worker 0 is ready",
      "[tfdp-launch] worker 1's last 1 line(s) are the same as worker 0's above; not printed "
      "again."]
