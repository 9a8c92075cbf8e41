"""Tests of the gradient path (tfdp.compat's gradient_path, tfdp.gradients.buckets, tfdp.gradients).

In process: the user's own MirroredStrategy over 2 logical CPUs against its
single-device twin on the same global batches (clipping, loss scaling,
gradient accumulation, weight decay), custom loops and fit side by side with
stock Keras and one device (tests/workers/gradient_parity.py), buckets
against one all-reduce, the compressions. On 2 real workers
(tests/workers/gradient_worker.py under tfdp-launch): the user's own
MultiWorkerMirroredStrategy with `import tfdp` first, a float16 overflow on
one worker, buckets and bf16 in the traced step, the side-by-side cases, and
a stuck collective.
"""

import os
import re
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import compat
from tfdp import errors
from tfdp.gradients import settings as gradients
from tfdp import launch
from tfdp.liveness import stall
from tfdp.gradients import buckets
from tests import shared
from tests.conftest import REPO, WORKERS
from tests.shared import shared_run
from tests.workers import gradient_parity

WORKER = os.path.join(WORKERS, "gradient_worker.py")
BATCH = 16
_CPUS = ("/cpu:0", "/cpu:1")


@pytest.fixture(autouse=True)
def _default_settings():
  gradients.reset()
  yield
  gradients.reset()


# -- the bucket plan (pure) ------------------------------------------------------


def test_buckets_take_the_last_gradients_first_with_a_small_first_bucket():
  sizes = [100, 10, 300, 10, 50, 10]  # forward order, as a model's variables
  assert buckets.plan(sizes, cap_bytes=200, first_bytes=40) == [[5, 4], [3, 2], [1, 0]]
  # A tensor larger than the cap is a bucket of its own; the rest closes the plan.
  assert buckets.plan([500, 10, 10], cap_bytes=100, first_bytes=0) == [[2, 1, 0]]
  assert buckets.plan([500, 10, 10, 500], cap_bytes=100, first_bytes=0) == [[3], [2, 1, 0]]
  assert buckets.plan(sizes, cap_bytes=0, first_bytes=40) == [[5, 4, 3, 2, 1, 0]]
  assert buckets.plan([], cap_bytes=100, first_bytes=10) == []


def test_settings_are_checked_and_make_strategy_sets_them():
  with pytest.raises(errors.ConfigError, match="gradient_compression must be one of bf16, fp16"):
    gradients.configure_gradients(compression="int8")
  with pytest.raises(errors.ConfigError, match="bucket_cap_mb must be a number >= 0"):
    gradients.configure_gradients(bucket_cap_mb=-1)
  with pytest.raises(errors.ConfigError, match="timeout must be > 0"):
    gradients.configure_gradients(timeout_seconds=0)
  assert gradients.configure_gradients(compression="none").compression is None
  assert gradients.current().timeout_seconds == gradients.DEFAULT_TIMEOUT_SECONDS
  from tfdp.distribute import strategy as tfdp_strategy  # pylint: disable=g-import-not-at-top
  tfdp_strategy.make_strategy("default", gradient_compression="bf16", timeout_seconds=30)
  assert gradients.current().compression == "bf16"
  assert gradients.current().timeout_seconds == 30
  tfdp_strategy.make_strategy("default")  # None keeps what is set
  assert gradients.current().compression == "bf16"


# -- the user's own MirroredStrategy against its single-device twin --------------


def _data(rows=8 * BATCH, overflow_rows=None, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 20)).astype("float32") * 3
  y = (x[:, :3].sum(axis=1) > 0).astype("int32")
  if overflow_rows is not None:
    x[overflow_rows] *= 3e4
  return x, y


def _fit(strategy, optimizer, x, y, policy="float32", epochs=1):
  """model.fit of a small MLP on (x, y) in batches of 16; returns the model."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    with strategy.scope():
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
                                keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(2, dtype="float32")])
      model.compile(optimizer=optimizer(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  finally:
    keras.mixed_precision.set_global_policy("float32")
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=epochs, verbose=0)
  return model


def _flat(variables):
  return np.concatenate([np.asarray(v).astype("float64").ravel() for v in variables])


@pytest.fixture(scope="module")
def mirrored():
  return tf.distribute.MirroredStrategy(_CPUS)


OPTIMIZERS = {
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
    "accumulation_and_decay": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1, gradient_accumulation_steps=2, global_clipnorm=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clipping_accumulation_and_decay_mean_what_they_mean_on_one_device(name, mirrored):
  # Upstream clips each replica's own (1/N-scaled) gradients before the
  # all-reduce: 8 steps of SGD(0.5) then differ from one device by 0.04 to
  # 0.11 (measured with TFDP_COMPAT_DISABLE=gradient_path); only the order
  # of float additions may differ here.
  x, y = _data()
  one = _fit(tf.distribute.get_strategy(), OPTIMIZERS[name], x, y)
  two = _fit(mirrored, OPTIMIZERS[name], x, y)
  np.testing.assert_allclose(_flat(two.weights), _flat(one.weights), rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(_flat(two.optimizer.variables), _flat(one.optimizer.variables),
                             rtol=1e-4, atol=1e-5)


def test_a_float16_overflow_on_one_replica_is_skipped_by_every_replica(mirrored):
  # The first batch's rows 8-15 (replica 1's half) overflow float16 at the
  # initial loss scale. One device skips that step and halves the scale;
  # upstream decides "finite" from replica 0's own gradients and applies
  # the overflow (non-finite weights, scale unchanged).
  x, y = _data(rows=4 * BATCH, overflow_rows=slice(8, 16))
  sgd = lambda: keras.optimizers.SGD(0.01)  # pylint: disable=unnecessary-lambda-assignment
  one = _fit(tf.distribute.get_strategy(), sgd, x, y, policy="mixed_float16")
  two = _fit(mirrored, sgd, x, y, policy="mixed_float16")
  assert np.isfinite(_flat(two.weights)).all()
  assert float(two.optimizer.dynamic_scale.numpy()) == float(one.optimizer.dynamic_scale.numpy())
  assert float(one.optimizer.dynamic_scale.numpy()) < 2.0 ** 15  # the overflow was seen
  assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 3
  np.testing.assert_allclose(_flat(two.weights), _flat(one.weights), rtol=1e-3, atol=1e-4)


def _accumulate_one_gradient_on_both_replicas(strategy, traced=False):
  """Issue 44's case: each replica applies [[1, 1], [2, 2]] (one tensor) 3 times with 3 accumulation steps."""
  with strategy.scope():
    v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=3)
    optimizer.build([v])
  grad = tf.constant([[1.0, 1.0], [2.0, 2.0]])
  step = lambda: strategy.run(lambda: optimizer.apply_gradients([(grad, v)]))  # pylint: disable=unnecessary-lambda-assignment
  step = tf.function(step) if traced else step
  for _ in range(3):
    step()
  return v.numpy()


def test_accumulation_applies_what_stock_keras_applies(mirrored):
  # Upstream all-reduces the accumulated mean on the update step, a tensor
  # of each replica's own: the replicas' sum, [[2, 2], [4, 4]]. Reducing
  # each step's gradient first counted the one tensor both replicas pass
  # once (ReplicaContext.all_reduce of an object every replica shares is
  # that object), and applied half of it: [[0, 1], [1, 2]].
  with gradient_parity.stock_keras():
    stock = _accumulate_one_gradient_on_both_replicas(mirrored)
  np.testing.assert_array_equal(stock, [[-1.0, 0.0], [-1.0, 0.0]])
  np.testing.assert_array_equal(_accumulate_one_gradient_on_both_replicas(mirrored), stock)
  # Traced (stock Keras fails there: `merge_call` inside its `cond`).
  np.testing.assert_array_equal(_accumulate_one_gradient_on_both_replicas(mirrored, traced=True),
                                stock)


@pytest.fixture(scope="module")
def one_device():
  return gradient_parity.one_device()


@pytest.fixture(scope="module")
def parity_2_replicas(mirrored):
  return gradient_parity.run_all(mirrored)


def _assert_parity(got, one, loop, option):
  """tfdp's run `got` ended as one device's `one` did (and as stock Keras's where it is right)."""
  name = f"{loop}/{option}"
  tfdp_run, one_run = got[f"tfdp/{name}"], one[f"one/{name}"]
  if option in gradient_parity.UPSTREAM_RIGHT:
    np.testing.assert_array_equal(tfdp_run["weights"], got[f"stock/{name}"]["weights"])
  # One device adds the rows' gradients in another order; float16 rounds.
  tolerance = dict(rtol=1e-3, atol=1e-4) if option == "loss_scale" else dict(rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(tfdp_run["weights"], one_run["weights"], **tolerance)
  assert int(tfdp_run["iterations"]) == int(one_run["iterations"])
  np.testing.assert_array_equal(tfdp_run["scale"], one_run["scale"])


PARITY_CASES = [(loop, option) for loop in gradient_parity.LOOPS
                for option in gradient_parity.OPTIONS]


@pytest.mark.parametrize("loop,option", PARITY_CASES)
def test_on_2_replicas_the_update_is_stock_keras_where_right_and_one_devices(
    loop, option, parity_2_replicas, one_device):
  _assert_parity(parity_2_replicas, one_device, loop, option)


def test_buckets_change_no_number(mirrored):
  x, y = _data()
  adam = lambda: keras.optimizers.Adam(0.01)  # pylint: disable=unnecessary-lambda-assignment
  gradients.configure_gradients(bucket_cap_mb=0)
  whole = _fit(mirrored, adam, x, y)
  # 4 KB buckets: this model's 6 gradients (8 B to 2.6 KB) in 2 buckets or more.
  sizes = [v.numpy().nbytes for v in whole.trainable_variables]
  assert len(buckets.plan(sizes, 4096, 1024)) >= 2
  gradients.configure_gradients(bucket_cap_mb=4096 / (1 << 20), first_bucket_mb=1024 / (1 << 20))
  bucketed = _fit(mirrored, adam, x, y)
  np.testing.assert_array_equal(_flat(bucketed.weights), _flat(whole.weights))
  np.testing.assert_array_equal(_flat(bucketed.optimizer.variables),
                                _flat(whole.optimizer.variables))


def test_compressed_all_reduces_stay_close_to_float32(mirrored):
  x, y = _data()
  sgd = lambda: keras.optimizers.SGD(0.1)  # pylint: disable=unnecessary-lambda-assignment
  exact = _flat(_fit(mirrored, sgd, x, y).weights)
  for compression, tolerance in (("bf16", 2e-2), ("fp16", 2e-3)):
    gradients.configure_gradients(compression=compression)
    got = _flat(_fit(mirrored, sgd, x, y).weights)
    assert not np.array_equal(got, exact), compression  # it did cast
    np.testing.assert_allclose(got, exact, atol=tolerance, err_msg=compression)


def test_a_float16_overflow_on_the_wire_is_a_skipped_step(mirrored):
  # fp16 compression with loss scaling: gradients finite in float32 but past
  # float16's range once scaled overflow in the all-reduce; every replica
  # sees the same inf and skips the step, as one device skips an overflow.
  x, y = _data(rows=BATCH)
  x[:] *= 30  # scaled by 2**15, its gradients pass 65504 in float16, not in float32
  sgd = lambda: keras.optimizers.SGD(0.01)  # pylint: disable=unnecessary-lambda-assignment
  plain = _fit(mirrored, sgd, x, y)
  assert np.isfinite(_flat(plain.weights)).all()
  gradients.configure_gradients(compression="fp16")
  model = _fit(mirrored, lambda: keras.mixed_precision.LossScaleOptimizer(sgd()), x, y)
  assert int(model.optimizer.iterations.numpy()) == 0
  assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 14
  assert np.isfinite(_flat(model.weights)).all()


def test_one_replica_and_no_strategy_run_upstream_unchanged():
  # Outside a replica context of 2 or more replicas the fix calls upstream:
  # the weights equal those of upstream's own code (the fix reverted).
  x, y = _data()
  clip = OPTIMIZERS["global_clipnorm"]
  patched = _flat(_fit(tf.distribute.get_strategy(), clip, x, y).weights)
  compat.revert()
  try:
    upstream = _flat(_fit(tf.distribute.get_strategy(), clip, x, y).weights)
  finally:
    compat.apply()
  np.testing.assert_array_equal(patched, upstream)


def test_the_collective_timeout_names_the_bucket_and_the_step():
  error = tf.errors.DeadlineExceededError(
      None, None, "Graph execution error:\n\nDetected at node "
      "tfdp_gradient_bucket_2_of_3/CollectiveReduceV2 defined at ...\n\ntfdp: a collective "
      "waited past the collective timeout\n\t [[{{node "
      "tfdp_gradient_bucket_2_of_3/CollectiveReduceV2}}]]")
  line = stall.describe(error, step=41, timeout=600)
  assert line.startswith("the gradient all-reduce of bucket 2 of 3 waited more than 600 s "
                         "at step 41: another worker is stuck"), line
  assert stall.describe(None, None, 5, "evaluate").startswith(
      "a collective waited more than 5 s in evaluate:")


def test_the_deadline_aborts_a_stuck_call_once_past_its_limit():
  # A call that never ends (a Python sleep stands for a collective TF would
  # abort): the thread fires after the limit, and a call within it is left alone.
  deadline = stall.Deadline(check_every=0.05)
  aborted = []
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  original = context.Context.abort_collective_ops
  context.Context.abort_collective_ops = lambda self, code, message: aborted.append(code)
  try:
    with deadline.watch(0.3, "step"):
      time.sleep(0.1)
    time.sleep(0.5)
    assert deadline.fired is None and not aborted
    with deadline.watch(0.2, "step"):
      time.sleep(0.6)
    assert deadline.fired == (0.2, "step") and aborted == [tf.errors.DEADLINE_EXCEEDED]
  finally:
    context.Context.abort_collective_ops = original


# -- 2 real workers: the user's own MultiWorkerMirroredStrategy -------------------


@shared_run("gradient_runs")
def gradient_runs(root):
  """gradient_worker.py's cases under tfdp-launch: one job that finishes, one that stalls."""
  def launch_job(out, cases):
    out.mkdir()
    env = shared.environ(TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.pop(compat.DISABLE_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--grace_seconds=2", "--",
         sys.executable, WORKER, str(out), cases],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
        check=False)
    return {"code": proc.returncode, "out": proc.stdout.decode("utf-8", errors="replace"),
            "dir": str(out)}

  return {"cases": launch_job(root / "cases", "f16,buckets,bf16,parity"),
          "stall": launch_job(root / "stall", "stall")}


def _results(run, case):
  return [dict(np.load(os.path.join(run["dir"], f"{case}-{w}.npz"))) for w in (0, 1)]


@pytest.mark.slow
def test_import_tfdp_first_then_the_users_own_multi_worker_fit_works(gradient_runs):
  run = gradient_runs["cases"]
  assert run["code"] == 0, run["out"][-3000:]
  # `import tfdp` before TensorFlow and Keras, no other tfdp call: the fixes
  # are in place (upstream fails on the first batch: "Attempt to convert a
  # value (PerReplica...").
  for w in (0, 1):
    assert re.search(rf"\[worker {w}\] GRADIENT compat \S*gradient_path\S*symbolic_build_batch",
                     run["out"]), run["out"][-3000:]


@pytest.mark.slow
def test_a_float16_overflow_on_one_worker_is_skipped_on_both(gradient_runs):
  # Upstream: worker 1 skips, worker 0 applies; their `cond`s around the
  # all-reduce diverge and the job hangs.
  a, b = _results(gradient_runs["cases"], "f16")
  assert np.isfinite(a["weights"]).all()
  np.testing.assert_array_equal(a["weights"], b["weights"])
  assert a["scale"] == b["scale"] < 2.0 ** 15
  assert a["steps"] == b["steps"] < 6


@pytest.mark.slow
def test_buckets_and_compression_are_in_the_traced_step(gradient_runs):
  a, b = _results(gradient_runs["cases"], "buckets")
  bucketed = [op for op in a["bucketed_ops"] if op.startswith(buckets.SCOPE)]
  assert {op.split("/")[0] for op in bucketed} == {f"{buckets.SCOPE}_1_of_2",
                                                   f"{buckets.SCOPE}_2_of_2"}, bucketed
  assert [op for op in a["ops"] if op.startswith(buckets.SCOPE)][0].startswith(
      f"{buckets.SCOPE}_1_of_1/")
  # 2 workers add each element's two values: the same sum in any grouping.
  np.testing.assert_array_equal(a["bucketed"], a["weights"])
  np.testing.assert_array_equal(a["weights"], b["weights"])
  c, d = _results(gradient_runs["cases"], "bf16")
  assert all(op.endswith(":bfloat16") for op in c["ops"] if op.startswith(buckets.SCOPE))
  np.testing.assert_array_equal(c["weights"], d["weights"])
  np.testing.assert_allclose(c["weights"], a["weights"], atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("loop,option", PARITY_CASES)
def test_on_2_workers_the_update_is_stock_keras_where_right_and_one_devices(
    loop, option, gradient_runs, one_device):
  a, b = _results(gradient_runs["cases"], "parity")
  got = {}
  for key in (k for k in a if "/" in k):  # "<path>/<loop>/<option>/<field>"
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    name, field = key.rsplit("/", 1)
    got.setdefault(name, {})[field] = a[key]
  _assert_parity(got, one_device, loop, option)


@pytest.mark.slow
def test_a_stuck_collective_fails_the_worker_with_one_line(gradient_runs):
  run = gradient_runs["stall"]
  out = run["out"]
  assert run["code"] == launch.EXIT_WORKER_FAILED, out[-3000:]
  assert re.search(r"\[worker 1\] \S*tfdp: collective \S+ waited more than 4 s at step 4: "
                   r"another worker is stuck or the workers took different paths .*exiting "
                   rf"with code {stall.EXIT_COLLECTIVE_TIMEOUT}\.", out), out[-3000:]
  assert "worker 1 failed: waited past the collective timeout" in out, out[-3000:]
  assert "Traceback" not in out, out[-3000:]


def test_a_loss_scale_optimizer_is_saved_with_the_scale_and_the_inner_step(tmp_path):
  # A LossScaleOptimizer and its inner optimizer both have an `iteration`:
  # the inner one is the global step (tfdp.resume.train_state.ITERATIONS_KEY), the
  # wrapper's own variables keep their full path.
  from tfdp.resume import train_state as state_lib  # pylint: disable=g-import-not-at-top
  x, y = _data(rows=BATCH)
  model = _fit(tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(0.01), x, y,
               policy="mixed_float16")
  model.optimizer.dynamic_scale.assign(64.0)
  path = state_lib.TrainState(model).checkpoint.write(str(tmp_path / "ckpt"))
  reader = tf.train.load_checkpoint(path)
  assert int(reader.get_tensor(state_lib.ITERATIONS_KEY)) == 1
  assert float(reader.get_tensor(
      "optimizer/loss_scale_optimizer/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE")) == 64.0
  model.optimizer.dynamic_scale.assign(1.0)
  state_lib.TrainState(model).checkpoint.read(path).assert_consumed()
  assert float(model.optimizer.dynamic_scale.numpy()) == 64.0


@pytest.mark.slow
def test_the_collective_timeout_holds_no_thread_per_collective(gradient_runs):
  # TF's own per-collective timeout keeps a timer thread per collective for
  # the whole timeout: these 3 cases grew a worker from 158 to 302 threads
  # with CommunicationOptions(timeout_seconds=600) (ResNet-20 grew by ~120 a
  # second, until thread creation failed). tfdp's deadline adds none.
  first, last = (int(_results(gradient_runs["cases"], c)[0]["threads"]) for c in ("f16", "bf16"))
  assert last - first <= 16, (first, last)
