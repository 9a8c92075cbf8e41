"""Smoke test of the benchmark scripts: each --smoke run writes JSON with the expected keys."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script -> top-level keys its JSON must have.
SCRIPTS = {
    "bench_train.py": ["machine", "throughput", "allreduce", "scaling", "load"],
    "bench_resume.py": ["machine", "rows", "ratio_largest_vs_smallest", "target"],
    "bench_checkpoint.py": ["rows", "targets", "machine"],
    "scaling_model.py": ["params", "rows", "references", "assumptions"],
    "bench_tiers.py": ["machine", "parts", "results"],
}
# Extra flags of a script's smoke run (its other parts start many processes).
EXTRA = {"bench_tiers.py": ["--parts=throughput", "--fit_variants=none,local", "--local_every=auto"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Runs every script's --smoke at once (they are mostly process start-up)."""
  tmp = tmp_path_factory.mktemp("bench")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  procs = {}
  for script in SCRIPTS:
    out = tmp / (script + ".json")
    log = open(tmp / (script + ".log"), "w")  # pylint: disable=consider-using-with
    procs[script] = (subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", script), "--smoke",
         f"--out={out}"] + EXTRA.get(script, []), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                     out, log)
  done = {}
  for script, (proc, out, log) in procs.items():
    try:
      code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
      proc.kill()
      code = "timeout"
    log.close()
    with open(log.name) as f:
      tail = f.read()[-4000:]
    done[script] = (code, out, tail)
  return done


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_writes_json(results, script):
  code, out, tail = results[script]
  assert code == 0, f"{script} --smoke failed ({code}):\n{tail}"
  with open(out) as f:
    data = json.load(f)
  for key in SCRIPTS[script]:
    assert key in data, f"{script}: no {key!r} in its JSON"
  if script == "bench_train.py":
    assert {r["variant"] for r in data["throughput"]["rows"]} == {
        "plain", "tfdp", "plain_ckpt", "tfdp_ckpt"}
    assert data["allreduce"]["rows"] and "tcp_MBps" in data["allreduce"]
    assert [r["workers"] for r in data["scaling"]["rows"]][:2] == [1, 2]
    # The alpha-beta prediction from the allreduce part's table ran too.
    assert data["scaling"]["rows"][1]["predicted_efficiency"] is not None
  if script == "bench_resume.py":
    assert {r["variant"] for r in data["rows"]} == {"tfdp", "stock"}
  if script == "bench_tiers.py":
    throughput = data["results"]["throughput"]["free"]
    assert throughput["targets"]["local@auto"]["ratio"] > 0
    assert all(i >= 1 for i in throughput["local_interval"]["local@auto"]), throughput

