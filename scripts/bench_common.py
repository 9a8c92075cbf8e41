"""Helpers shared by the benchmark scripts: machine facts, load, step timing, tables, JSON."""

import datetime
import json
import os
import platform
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_root():
  return _REPO


def ensure_repo_on_path():
  """Lets a script run from a checkout (`python scripts/x.py`) import tfdp and models."""
  if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def worker_env(extra=None):
  """Environment for a benchmark subprocess: repo importable, TF quiet."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra or {})
  return env


def load_average():
  """(1, 5, 15)-minute load averages, or None where the OS has none."""
  try:
    return tuple(round(x, 2) for x in os.getloadavg())
  except OSError:
    return None


def machine():
  """Facts for docs/performance.md: CPUs, CPU model, RAM, versions, date, load."""
  cpu_model = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu_model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  ram_gib = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          ram_gib = round(int(line.split()[1]) / (1 << 20), 1)
          break
  except OSError:
    pass
  info = {"nproc": os.cpu_count(), "cpu_model": cpu_model, "ram_gib": ram_gib,
          "python": platform.python_version(),
          "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
              "%Y-%m-%d %H:%M UTC"),
          "load_avg_start": load_average()}
  # Package metadata, not imports: importing TF costs seconds per process.
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  for key, dist in (("tensorflow", "tensorflow"), ("keras", "keras")):
    try:
      info[key] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      info[key] = None
  return info


def wait_for_quiet(max_load=1.5, max_wait_s=0.0, poll_s=15.0, log=None):
  """Waits (up to max_wait_s) until the 1-minute load is at most max_load.

  Returns:
    The load average when it returned (quiet or not).
  """
  deadline = time.monotonic() + max_wait_s
  while True:
    load = load_average()
    if load is None or load[0] <= max_load or time.monotonic() >= deadline:
      return load
    if log:
      log(f"load average {load[0]:.2f} > {max_load}; waiting")
    time.sleep(poll_s)


def median(xs):
  return statistics.median(xs) if xs else float("nan")


def window_rates(stamps, examples_per_step, warmup_steps, window_steps):
  """Examples/s of consecutive windows of `window_steps` steps after warm-up.

  Args:
    stamps: perf_counter() at the end of each step, in order.
    examples_per_step: global batch size.
    warmup_steps: steps left out at the start (tracing, pipeline fill).
    window_steps: steps per window.

  Returns:
    A list of rates, one per complete window.
  """
  rates = []
  i = warmup_steps
  while i + window_steps < len(stamps):
    dt = stamps[i + window_steps] - stamps[i]
    rates.append(window_steps * examples_per_step / dt)
    i += window_steps
  return rates


def step_stamps_callback():
  """A Keras callback recording perf_counter() at every train-batch end (in `.stamps`)."""
  import keras  # pylint: disable=g-import-not-at-top

  class StepStamps(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.stamps = []

    def on_train_batch_end(self, batch, logs=None):
      self.stamps.append(time.perf_counter())

  return StepStamps()


def table(rows, cols):
  """A markdown table; cols: (key, header, format) triples; missing values are '-'."""
  lines = ["| " + " | ".join(c[1] for c in cols) + " |",
           "|" + "|".join("---" for _ in cols) + "|"]
  for r in rows:
    cells = []
    for key, _, fmt in cols:
      v = r.get(key)
      cells.append("-" if v is None else (fmt.format(v) if fmt else str(v)))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_json(path, obj):
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True, default=str)
  os.replace(tmp, path)


def resume_rows(samples, steps, stock_max):
  """Median rows of resume samples {(variant, step): [dict]}, stock projected past stock_max.

  Stock beyond `stock_max` is a line through its two largest measured steps
  (its cost grows linearly with the step); those rows have `projected`.
  Sorted tfdp first, then by step.
  """
  rows = []
  for (variant, k), ss in samples.items():
    row = {"variant": variant, "step": k, "rounds": len(ss)}
    for key in ss[0]:
      row[key] = median([s[key] for s in ss])
    rows.append(row)
  stock = sorted((r for r in rows if r["variant"] == "stock"), key=lambda r: r["step"])
  if len(stock) >= 2:
    (k1, t1), (k2, t2) = [(r["step"], r["to_first_step_s"]) for r in stock[-2:]]
    slope = max(0.0, (t2 - t1) / (k2 - k1))
    rows += [{"variant": "stock", "step": k, "projected": True,
              "to_first_step_s": t2 + slope * (k - k2)} for k in steps if k > stock_max]
  rows.sort(key=lambda r: (r["variant"] != "tfdp", r["step"]))
  return rows
