"""Shared pieces of the fault-tolerance tests: the tiny training job, its uninterrupted reference, weight comparison."""

import io
import os
import sys

import numpy as np

from tfdp import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FT_TRAIN = os.path.join(REPO, "tests", "workers", "ft_train.py")
STEPS = 200
# Tiny and deterministic: 16 steps an epoch, a checkpoint every 20 steps.
TRAIN_FLAGS = ["--strategy=multi_worker", "--model=cnn", "--dataset=synthetic",
               "--num_examples=256", "--global_batch_size=16", "--seed=3",
               "--deterministic", f"--train_steps={STEPS}",
               "--checkpoint_every_steps=20", "--max_to_keep=3"]
# The tests' runs of the job (the shared reference, the chaos and network-namespace
# runs) stop at TEST_STEPS: what they check needs 5 kills, not 200 steps (which
# scripts/bench_tiers.py's chaos part keeps); each step costs about 40 ms of CPU
# per worker, and a start-up about 5 s.
TEST_STEPS = 100
TEST_FLAGS = [f"--train_steps={TEST_STEPS}"]


def env(base=None, **extra):
  """The workers' environment: `base` (default: this process's), the repo on PYTHONPATH, `extra`."""
  e = dict(os.environ if base is None else base)
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  e["TF_CPP_MIN_LOG_LEVEL"] = "2"
  for k in ("TF_CONFIG", "FT_CHAOS_PLAN", "TFDP_CKPT_TEST_CRASH_AT"):
    e.pop(k, None)
  e.update(extra)
  return e


def command(model_dir, flags=()):
  """The job's command; `flags` override TRAIN_FLAGS of the same names."""
  names = {f.split("=", 1)[0] for f in flags}
  return ([sys.executable, FT_TRAIN]
          + [f for f in TRAIN_FLAGS if f.split("=", 1)[0] not in names]
          + list(flags) + [f"--model_dir={model_dir}"])


def run_job(model_dir, log_path, flags=(), **launch_kw):
  """Runs the job under tfdp-launch in this process; returns (exit code, output)."""
  out = io.StringIO()
  launch_kw.setdefault("env", env())
  launch_kw.setdefault("grace_seconds", 5)
  code = launch.launch(command(model_dir, flags), launch_kw.pop("num_workers", 2),
                       out=out, **launch_kw)
  with open(log_path, "w", encoding="utf-8") as f:
    f.write(out.getvalue())
  return code, out.getvalue()


def reference_run(root):
  """One uninterrupted 2-worker run to TEST_STEPS in folder `root`: {"model_dir"}.

  The `ft_reference` fixture of tests/conftest.py (made once per session).
  """
  from tests import shared  # pylint: disable=g-import-not-at-top
  model_dir = str(root / "model")
  # The session's environment: this may run beside a test that monkeypatches it.
  code, out = run_job(model_dir, str(root / "log.txt"), TEST_FLAGS, env=env(base=shared.environ()))
  assert code == 0, out[-5000:]
  return {"model_dir": model_dir}


def reference(tmp_path_factory):
  """model_dir of `reference_run`, made once per session (tests/shared.py)."""
  from tests import shared  # pylint: disable=g-import-not-at-top
  return shared.once_per_session(tmp_path_factory, "ft_reference", reference_run)["model_dir"]


def final_weights(model_dir, step=TEST_STEPS):
  """Every model and optimizer tensor of the checkpoint at `step`, as bytes."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = os.path.join(model_dir, f"ckpt-{step}")
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("model/", "optimizer/"))}


def differences(a, b):
  """Human-readable list of tensors that are not bitwise equal."""
  out = []
  for k in sorted(set(a) | set(b)):
    if k not in a or k not in b:
      out.append(f"{k}: only in {'first' if k in a else 'second'}")
      continue
    x, y = np.asarray(a[k]), np.asarray(b[k])
    if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
      diff = (np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
              if x.shape == y.shape and x.dtype.kind in "fiu" else "n/a")
      out.append(f"{k}: max |diff| {diff}")
  return out


def verify_all(model_dir):
  """(checkpoint prefixes on disk, problems tfdp-ckpt verify reports)."""
  from tfdp.cli import ckpt  # pylint: disable=g-import-not-at-top
  prefixes = sorted({os.path.join(model_dir, f.split(".")[0])
                     for f in os.listdir(model_dir) if f.startswith("ckpt-")})
  problems = []
  for p in prefixes:
    buf = io.StringIO()
    if ckpt.main(["verify", p], out=buf) != 0:
      problems.append(buf.getvalue())
  return prefixes, problems
