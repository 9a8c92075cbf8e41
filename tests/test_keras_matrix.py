"""The Keras fit matrix: ordinary Keras scripts with tfdp's BackupAndRestore under every strategy, killed and resumed.

Every cell is tests/workers/matrix_worker.py's script (a small conv net,
AdamW with a cosine schedule, op determinism on; Keras's BackupAndRestore
swapped for tfdp's with save_freq=5, not a multiple of steps_per_execution
3): `fit` (3 epochs of 10 steps; 12 with `repeat` and spe 3, as Keras runs
whole executions), `evaluate`, `predict`. The cells (a
covering design: every strategy with both steps_per_execution and every
input, both steps_per_execution with every input, every option in cells of
several strategies):

| cell         | strategy                                   | input  | spe | options          |
|--------------|--------------------------------------------|--------|-----|------------------|
| none-repeat  | no strategy                                | repeat | 3   | rand, clip       |
| none-finite  | no strategy                                | finite | 1   | val, f16         |
| none-arrays  | no strategy                                | arrays | 3   | cw, bf16, gc16   |
| own-repeat   | the user's MirroredStrategy, 2 CPUs        | repeat | 1   | cw, f16          |
| own-finite   | the user's MirroredStrategy, 2 CPUs        | finite | 3   | rand, val        |
| own-arrays   | the user's MirroredStrategy, 2 CPUs        | arrays | 3   | bf16, gc16       |
| tfdp-repeat  | make_strategy("mirrored", cpu_replicas=2)  | repeat | 3   | val, clip        |
| tfdp-finite  | make_strategy("mirrored", cpu_replicas=2)  | finite | 1   | cw, bf16, gc16   |
| tfdp-arrays  | make_strategy("mirrored", cpu_replicas=2)  | arrays | 1   | rand, f16        |
| mw1-repeat   | the user's MultiWorkerMirroredStrategy 2x1 | repeat | 1   | bf16, gc16       |
| mw1-finite   | the user's MultiWorkerMirroredStrategy 2x1 | finite | 3   | cw, clip         |
| mw1-arrays   | the user's MultiWorkerMirroredStrategy 2x1 | arrays | 1   | val, rand, f16   |
| mw2-repeat   | make_strategy(cpu_replicas=2), 2 workers   | repeat | 3   | cw, rand, bf16   |
| mw2-finite   | make_strategy(cpu_replicas=2), 2 workers   | finite | 3   | val, gc16        |
| mw2-arrays   | make_strategy(cpu_replicas=2), 2 workers   | arrays | 1   | cw, clip, f16    |

Inputs: `repeat` a repeated, shuffled dataset with steps_per_epoch=10 (8
batches a pass); `finite` a shuffled dataset of 10 batches; `arrays` numpy
arrays. Options: `val` validation_data with validation_freq=2; `cw`
class_weight; `bf16` the mixed_bfloat16 policy, logits included (so
`predict` gathers bfloat16 outputs across workers); `f16` the mixed_float16
policy (dynamic loss scaling); `clip` global_clipnorm=0.1; `gc16`
gradient_compression="bf16"; `rand` RandomFlip, RandomTranslation and
Dropout in the model. 2x1 and 2x2 run as real workers
through `tfdp-launch --num_workers=2`.

Processes are shared: each topology (one process for the three single-host
strategies, a 2-worker job for each multi-worker one) runs its cells one
after the other, three times: uninterrupted (the reference), then paused and
SIGKILLed, then the same command again. Paused: each cell stops mid epoch 2,
at the first step after a backup of that epoch, and runs the next cell there,
inside its callback; the last announces itself on stdout and the test
SIGKILLs the process (a 2-worker job: the chief of 2x1, worker 1 of 2x2). So
one kill leaves every cell mid-epoch, and the rerun resumes each from its
backup. The single-host reference process also runs the single-device twin
(no strategy, no backup) of every distributed cell without random layers.

Agreement with the single-device run: the same data in the same order (with
tfdp.compat's symbolic_build_batch a strategy no longer draws an extra
reshuffle of the input before training), the same initial weights and
steps; only the order of floating-point reductions differs (each replica's
mean loss over 8 or 4 rows and the gradient all-reduce, against one mean over
16 rows), a few float32 ulps (1e-7 relative) in a gradient. AdamW divides
each gradient by the root of its second moment, so a relative error carries
into an update nearly unchanged, and 30 updates of at most lr=0.01 add them
up: weights of order 0.1 to 1 move apart by about 1e-7 to 1e-6 (measured:
at most 2.3e-7). Stated tolerance: atol=1e-5, rtol=1e-4. The `clip` cells
are held to it too: tfdp.compat's gradient_path clips the all-reduced
gradients, as one device clips its own (measured: 1.0e-7 and 8.9e-8 apart;
upstream clips each replica's share, tests/test_gradient_path.py).
mixed_bfloat16 computes in bfloat16 (8 bits of mantissa), and its CPU
kernels round differently for 8 rows and for 16: an activation rounded the
other way is a 0.4% change, and for a weight whose gradient is near zero
AdamW's update (about lr) can change sign. Measured: weights at most 0.042
apart after moving 0.13 (with bfloat16 gradient all-reduces: `gc16`),
evaluation losses up to 1.03% apart (the logits are bfloat16 too).
mixed_float16 (10 bits of mantissa): weights at most 0.012 apart,
evaluation losses 0.04%. `gc16` alone (float32 compute, bfloat16 gradient
sums): each half is 0.4% off at most, but where the two workers' halves
nearly cancel the sum's sign can flip, and AdamW then moves that weight by
about lr the other way: measured 0.024 apart (mw2-finite). Stated tolerance
for all three: atol=0.06 on the weights and 2% on the evaluation loss.
Cells with random layers have no single-device twin: Keras 3 draws the same random numbers on every replica
(the layers' SeedGenerator state is mirrored), so 2 replicas augment rows
8-15 with the draws of rows 0-7, a different computation from one device's,
not a different reduction order.
"""

import concurrent.futures
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data import iterators
from tests import shared
from tests.conftest import REPO, WORKERS
from tests.shared import shared_run

WORKER = os.path.join(WORKERS, "matrix_worker.py")
PAUSE_ENV = "TFDP_MATRIX_PAUSE"

# name: (topology, strategy in the worker, input, steps_per_execution, options).
CELLS = {
    "none-repeat": ("single", "none", "repeat", 3, "rand+clip"),
    "none-finite": ("single", "none", "finite", 1, "val+f16"),
    "none-arrays": ("single", "none", "arrays", 3, "cw+bf16+gc16"),
    "own-repeat": ("single", "own", "repeat", 1, "cw+f16"),
    "own-finite": ("single", "own", "finite", 3, "rand+val"),
    "own-arrays": ("single", "own", "arrays", 3, "bf16+gc16"),
    "tfdp-repeat": ("single", "tfdp", "repeat", 3, "val+clip"),
    "tfdp-finite": ("single", "tfdp", "finite", 1, "cw+bf16+gc16"),
    "tfdp-arrays": ("single", "tfdp", "arrays", 1, "rand+f16"),
    "mw1-repeat": ("mw1", "multi_worker", "repeat", 1, "bf16+gc16"),
    "mw1-finite": ("mw1", "multi_worker", "finite", 3, "cw+clip"),
    "mw1-arrays": ("mw1", "multi_worker", "arrays", 1, "val+rand+f16"),
    "mw2-repeat": ("mw2", "multi_worker", "repeat", 3, "cw+rand+bf16"),
    "mw2-finite": ("mw2", "multi_worker", "finite", 3, "val+gc16"),
    "mw2-arrays": ("mw2", "multi_worker", "arrays", 1, "cw+clip+f16"),
}
# topology: (workers, CPU replicas per worker, the worker killed).
TOPOLOGIES = {"single": (1, 1, 0), "mw1": (2, 1, 0), "mw2": (2, 2, 1)}
TWINS = sorted(c for c, spec in CELLS.items() if spec[1] != "none" and "rand" not in spec[4])
STEPS_PER_EPOCH, EPOCHS = 10, 3
OPTIONS = ("val", "cw", "bf16", "f16", "clip", "gc16", "rand")
PAUSED = re.compile(r"MATRIX PAUSED pid=(\d+) worker=(\d+)")
STOPPED = re.compile(r"MATRIX (\S+) paused at step (\d+) saved=(\d+)")
TIMEOUT = 420


def _spec(name, twin=False):
  _, strategy, kind, spe, options = CELLS[name]
  if twin:
    return f"{name}@twin:{strategy}:{kind}:{spe}:{options}+twin"
  return f"{name}:{strategy}:{kind}:{spe}:{options}"


def _command(topology, out_dir, twins=False):
  workers, replicas, _ = TOPOLOGIES[topology]
  specs = [_spec(c) for c in CELLS if CELLS[c][0] == topology]
  if twins:
    specs += [_spec(c, twin=True) for c in TWINS]
  worker = [sys.executable, WORKER, str(out_dir), ",".join(specs), str(replicas)]
  if workers == 1:
    return worker
  return [sys.executable, "-m", "tfdp.launch", f"--num_workers={workers}", "--"] + worker


def _run(topology, command, pause):
  """Runs `command`; with `pause`, SIGKILLs the chosen worker once every worker has paused.

  Returns:
    (exit code, output).
  """
  workers, _, victim = TOPOLOGIES[topology]
  # The session's environment: this runs beside tests that may monkeypatch it.
  env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  env.pop("TFDP_COMPAT_DISABLE", None)
  env.pop(PAUSE_ENV, None)
  if pause:
    env[PAUSE_ENV] = "1"
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True)
  timer = threading.Timer(TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
  timer.start()
  lines, paused = [], {}
  try:
    for line in proc.stdout:
      lines.append(line)
      found = PAUSED.search(line)
      if pause and found:
        paused[int(found.group(2))] = int(found.group(1))
        if len(paused) == workers:
          os.kill(paused[victim], signal.SIGKILL)
    return proc.wait(), "".join(lines)
  finally:
    timer.cancel()


def _topology_runs(topology, root):
  """The reference, the killed run and its rerun of one topology; returns what the tests read."""
  ref, cut = root / topology / "ref", root / topology / "cut"
  runs = {}
  runs["ref"] = _run(topology, _command(topology, ref, twins=topology == "single"), pause=False)
  runs["cut"] = _run(topology, _command(topology, cut), pause=True)
  runs["resumed"] = _run(topology, _command(topology, cut), pause=False)
  return {"ref": str(ref), "cut": str(cut), "runs": runs}


@shared_run("matrix")
def matrix(root):
  """Every topology's three runs: the single-host one beside the two 2-worker jobs (one after the other).

  A shared run (tests/shared.py): started early, beside the tests before this file.
  """
  def multi_worker():
    return {t: _topology_runs(t, root) for t in ("mw1", "mw2")}

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    single = pool.submit(_topology_runs, "single", root)
    others = pool.submit(multi_worker)
    return {"single": single.result(), **others.result()}


def _topology(matrix, cell):
  return matrix[CELLS[cell][0]]


def _result(directory, cell, worker=0):
  return dict(np.load(pathlib.Path(directory) / cell / f"result-{worker}.npz"))


def _workers(cell):
  return range(TOPOLOGIES[CELLS[cell][0]][0])


def _expected_steps(cell):
  _, _, kind, spe, _ = CELLS[cell]
  if kind == "repeat":
    # Keras 3 runs whole executions: steps_per_epoch=10 with spe=3 is 12 steps.
    return EPOCHS * -(-STEPS_PER_EPOCH // spe) * spe
  return EPOCHS * STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_fit_evaluate_and_predict_work(matrix, cell):
  runs = _topology(matrix, cell)
  code, out = runs["runs"]["ref"]
  assert code == 0, out[-5000:]
  results = [_result(runs["ref"], cell, w) for w in _workers(cell)]
  first = results[0]
  assert int(first["steps"]) == _expected_steps(cell)
  assert np.isfinite(first["weights"]).all() and np.isfinite(first["eval_loss"])
  assert 0.0 <= float(first["eval_accuracy"]) <= 1.0
  assert first["predicted"].shape == (48, 3)
  options = CELLS[cell][4].split("+")
  tolerance = 2e-2 if "bf16" in options else 5e-3 if "f16" in options else 1e-5
  np.testing.assert_allclose(first["predicted"], first["direct"], rtol=tolerance, atol=tolerance)
  # bf16 logits: predict gathers bfloat16 outputs (across workers too).
  assert str(first["predicted_dtype"]) == ("bfloat16" if "bf16" in options else "float32")
  # validation_freq=2 of 3 epochs: validated once.
  assert int(first["val_epochs"]) == (1 if "val" in CELLS[cell][4] else 0)
  for other in results[1:]:  # Every worker ends with the same model and outputs.
    for key in ("weights", "optimizer", "predicted", "eval_loss"):
      np.testing.assert_array_equal(first[key], other[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_sigkill_mid_epoch_and_the_same_command_end_bitwise_equal(matrix, cell):
  runs = _topology(matrix, cell)
  code, out = runs["runs"]["cut"]
  assert "MATRIX PAUSED" in out, out[-5000:]
  if len(_workers(cell)) == 1:
    assert code == -signal.SIGKILL, out[-5000:]
  else:  # The launcher stops the other worker and fails.
    assert code != 0 and "was killed by SIGKILL" in out, out[-5000:]
  stops = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in STOPPED.finditer(out)}
  stop, saved = stops[cell]
  code, out = runs["runs"]["resumed"]
  assert code == 0, out[-5000:]
  for worker in _workers(cell):
    ref, resumed = _result(runs["ref"], cell, worker), _result(runs["cut"], cell, worker)
    # Resumed from the backup mid epoch 2, before the step the process stopped at.
    per_epoch = _expected_steps(cell) // EPOCHS
    assert int(resumed["restored"]) == saved < stop, (resumed["restored"], saved, stop)
    assert per_epoch < saved < stop < 2 * per_epoch
    for key in ("steps", "weights", "optimizer", "predicted", "direct", "eval_loss",
                "eval_accuracy", "val_epochs"):
      np.testing.assert_array_equal(ref[key], resumed[key], err_msg=f"{cell} worker {worker} {key}")


@pytest.mark.slow
@pytest.mark.parametrize("cell", TWINS)
def test_each_topology_agrees_with_the_single_device_run(matrix, cell):
  twin = _result(matrix["single"]["ref"], f"{cell}@twin")
  ref = _result(_topology(matrix, cell)["ref"], cell)
  np.testing.assert_array_equal(twin["initial"], ref["initial"])  # the same start
  assert int(twin["steps"]) == int(ref["steps"])
  options = CELLS[cell][4].split("+")
  if {"bf16", "f16", "gc16"} & set(options):
    np.testing.assert_allclose(ref["weights"], twin["weights"], rtol=0, atol=0.06)
    np.testing.assert_allclose(ref["eval_loss"], twin["eval_loss"], rtol=0.02)
  else:
    np.testing.assert_allclose(ref["weights"], twin["weights"], rtol=1e-4, atol=1e-5)


def test_matrix_covers_every_strategy_with_each_spe_and_input_and_every_option():
  strategies = {(CELLS[c][0], CELLS[c][1]) for c in CELLS}
  assert len(strategies) == 5
  pairs = set()
  for topology, strategy, kind, spe, options in CELLS.values():
    pairs |= {("s-spe", topology, strategy, spe), ("s-in", topology, strategy, kind),
              ("spe-in", spe, kind)}
    assert all(o in OPTIONS for o in options.split("+"))
  assert len([p for p in pairs if p[0] == "s-spe"]) == 5 * 2
  assert len([p for p in pairs if p[0] == "s-in"]) == 5 * 3
  assert len([p for p in pairs if p[0] == "spe-in"]) == 2 * 3
  for option in OPTIONS:
    assert {CELLS[c][1] for c in CELLS if option in CELLS[c][4].split("+")} >= {"none", "multi_worker"}
  # Every distributed topology is compared with the single-device run.
  assert {CELLS[c][:2] for c in TWINS} == strategies - {("single", "none")}


# Why the class_weight cells under more than one replica did not resume
# bitwise: in-process, the iterators a checkpointable dataset makes after a
# restored one.


def _async_after_prefetch_pipeline():
  # A prefetch read by a parallel map read by a prefetch: Keras's class_weight
  # map (parallelized by tf.data) after a pipeline that ends in prefetch.
  return (tf.data.Dataset.range(64).shuffle(32, seed=3).batch(8).prefetch(2)
          .map(lambda b: (b, tf.ones_like(b)), num_parallel_calls=2).prefetch(2))


def _epoch(strategy, iterator):
  return [np.concatenate([t.numpy() for t in strategy.experimental_local_results(e[0])])
          .tolist() for e in iterator]


@pytest.mark.parametrize("replicas", [1, 2])
def test_iterators_after_a_restored_one_start_as_in_the_uninterrupted_run(replicas):
  devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
  strategy = (tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute
                                             .ReductionToOneDevice())
              if replicas > 1 else tf.distribute.get_strategy())
  for made in (0, 1):  # The restored iterator is the first made, or the second.
    dist = iterators.checkpointable(_async_after_prefetch_pipeline(), strategy)
    for _ in range(made):
      next(iter(dist))
    first = iter(dist)
    for _ in range(3):
      next(first)
    state = first.state()
    expected = [_epoch(strategy, first)] + [_epoch(strategy, iter(dist)) for _ in range(3)]
    resumed = iterators.checkpointable(_async_after_prefetch_pipeline(), strategy)
    resumed.later_iterators = 3
    resumed.set_pending(state, made)
    got = [_epoch(strategy, iter(resumed)) for _ in range(4)]
    assert got == expected, made
