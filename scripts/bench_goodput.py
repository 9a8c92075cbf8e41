"""Micro-benchmark of goodput's per-step cost: the progress file's two stores against the old per-step path.

  python scripts/bench_goodput.py [--calls=200000] [--out=results.json]

Rows (nanoseconds per call, the median of --repeats runs):
- `Progress.mark`: the two stores into the mapped progress file.
- a worker's `Recorder.step` now (the stores and a clock read) and before
  (a method that returns at once: workers recorded nothing).
- the chief's `Recorder.step` now and before (the same Recorder without its
  progress file), its record rewritten at most twice a second in both.
- for scale: rewriting a heartbeat-like file (open, write, close), what
  knowing the step at every step would cost with a file write, and an
  atomic JSON rewrite of the record.
"""

import argparse
import os
import tempfile
import time
import timeit

import bench_common

bench_common.ensure_repo_on_path()

from tfdp import goodput  # pylint: disable=g-import-not-at-top,wrong-import-position


class _Returns:
  """What a worker's `Recorder.step` was before the ledger: a call that returns at once."""

  chief = False

  def step(self, step):
    if not self.chief:
      return


def _ns_per_call(fn, calls, repeats):
  runs = timeit.repeat(fn, number=calls, repeat=repeats)
  return bench_common.median([r / calls * 1e9 for r in runs])


def _steps(recorder):
  counter = iter(range(1, 1 << 62))
  return lambda: recorder.step(next(counter))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=200_000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--smoke", action="store_true", help="few calls (a test)")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  args = parser.parse_args()
  calls = 2_000 if args.smoke else args.calls
  for name in (goodput.ENV_FILE, goodput.ENV_ATTEMPT_START, goodput.ENV_HISTORY,
               goodput.ENV_HIGH_WATER):
    os.environ.pop(name, None)
  with tempfile.TemporaryDirectory() as d:
    chief = goodput.Recorder(d, tensorboard=False)
    worker = goodput.Recorder(d, chief=False)
    old_chief = goodput.Recorder(d, tensorboard=False)
    old_chief._progress = None  # pylint: disable=protected-access
    progress = worker._progress  # pylint: disable=protected-access
    beat_file = os.path.join(d, "beat")
    record_file = os.path.join(d, "record.json")
    counter = iter(range(1, 1 << 62))

    def beat():
      with open(beat_file, "w", encoding="utf-8") as f:
        f.write(f"{next(counter)} {time.time():.3f}\n")

    rows = [
        ("Progress.mark (2 stores)", lambda: progress.mark(7, 1.0), calls),
        ("worker Recorder.step, now", _steps(worker), calls),
        ("worker Recorder.step, before", _steps(_Returns()), calls),
        ("chief Recorder.step, now", _steps(chief), calls),
        ("chief Recorder.step, before", _steps(old_chief), calls),
        ("time.time()", time.time, calls),
        ("a file rewritten per step (heartbeat-like)", beat, max(100, calls // 50)),
        ("the record rewritten atomically (JSON)",
         lambda: goodput.write_json_atomic(record_file, chief.record), max(100, calls // 200)),
    ]
    results = [{"what": what, "ns_per_call": _ns_per_call(fn, n, args.repeats), "calls": n}
               for what, fn, n in rows]
    # The stores reach the file that a reader (the launcher, a rerun) reads.
    assert goodput.ledger.read_progress(progress.path)["step"] == progress.step > 7
  print(bench_common.table(results, [("what", "per step", None),
                                     ("ns_per_call", "ns per call", "{:.0f}")]))
  bench_common.write_json(args.out, {"machine": bench_common.machine(), "rows": results,
                                     "calls": calls})


if __name__ == "__main__":
  main()
