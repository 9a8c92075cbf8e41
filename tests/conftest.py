"""Shared test set-up: quiet TF logs, two logical CPUs in-process, real multi-worker runners, shared runs started early."""

import concurrent.futures
import gc
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TF's oneDNN custom CPU kernels off, in this process and (by inheritance)
# every process the tests start: on the suite's small models they cost 23%
# more CPU (a matrix process of 3 cells: 16.1 against 12.4 CPU-s), and they
# are what TF's start-up line warns may round differently. The code paths of
# tfdp are the same either way; the user-path tests (tests/test_user_path.py)
# and the CLI's start-up-lines test run with TF's default, and
# TF_ENABLE_ONEDNN_OPTS=1 runs the whole suite with it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# Every Python process the tests start imports TensorFlow and Keras with the
# cyclic collector paused and then freezes what the import made
# (tests/site/sitecustomize.py, on PYTHONPATH): about 0.5 CPU-s less in each
# of the suite's ~200 TensorFlow processes, the same numbers; the user-path
# tests run without it (users_environ), and TFDP_TEST_PLAIN_GC=1 turns it off.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
if SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in [SITE, os.environ.get("PYTHONPATH")] if p)


def users_environ(env):
  """`env` without the test session's own settings above: the environment a user runs with."""
  env = dict(env)
  env.pop("TF_ENABLE_ONEDNN_OPTS", None)
  path = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
  if path:
    env["PYTHONPATH"] = os.pathsep.join(path)
  return env


import pytest  # pylint: disable=g-import-not-at-top

from tests import shared  # pylint: disable=g-import-not-at-top
from tests.shared import shared_run  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def pytest_configure(config):
  # In-process tests mirror over 2 logical CPUs; this must happen before TF
  # initialises its devices, i.e. before any test creates a tensor.
  from tfdp.distribute import strategy  # pylint: disable=g-import-not-at-top
  strategy.configure_cpu_replicas(2)


def _collect_and_freeze():
  gc.collect()
  gc.freeze()


def pytest_collection_finish(session):
  # What the imports made lives as long as the session: out of the
  # collector's sight (gc.freeze), so that a collection costs milliseconds.
  _collect_and_freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
  # A test's garbage is freed when the test ends, not at some later
  # collection: a tf.data iterator left in a reference cycle (by the test or
  # by Keras) and freed minutes later can stall the whole process up to 60 s,
  # holding the GIL. TF 2.21's autotuning thread sleeps for a period that
  # doubles up to 60 s and can miss its cancellation's wake-up (docs/data.md,
  # "State size"). Measured in the suite before this: collections of 13.7,
  # 30 and 121 s in tests that had made no such iterator.
  # What the test leaves alive is frozen too, so that each collection scans
  # only one test's objects (a full one late in the session took up to 0.9 s);
  # a frozen cycle that a later test drops is never collected, a bounded leak
  # for a test session.
  result = yield  # the test's fixtures are torn down first
  _collect_and_freeze()
  return result


def launch_workers(command, num_workers=2, env=None, timeout=300):
  """Runs `command` as real local workers through `python -m tfdp.launch`.

  Returns:
    (exit code, combined output).
  """
  full_env = shared.environ(**(env or {}))
  full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  cmd = [sys.executable, "-m", "tfdp.launch", f"--num_workers={num_workers}",
         "--"] + list(command)
  proc = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                        check=False)
  return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


def run_all(calls, parallel=2):
  """Calls each of `calls` (functions of no arguments), `parallel` at a time.

  For independent processes of one test: a process that starts TensorFlow
  spends seconds on one core, so two at a time use both cores of a small host.

  Returns:
    Their results, in the order of `calls`.
  """
  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    return list(pool.map(lambda call: call(), calls))


@pytest.fixture
def run_workers():
  return launch_workers


@pytest.fixture(scope="session", autouse=True)
def _early_runs(request, tmp_path_factory):
  """Starts making the shared runs that the selected tests use (tests/shared.py)."""
  with shared.early(request.session.items, tmp_path_factory):
    yield


@shared_run("train_runs")
def train_runs(root):
  """tests/train_run.py: one small tfdp-train run SIGKILLed, resumed and rerun."""
  from tests import train_run  # pylint: disable=g-import-not-at-top
  return train_run.killed_resumed_rerun(root)


@shared_run("resume_runs")
def resume_runs(root):
  """tests/resume_run.py: the 2-worker reference, a SIGKILLed run and their reruns."""
  from tests import resume_run  # pylint: disable=g-import-not-at-top
  return resume_run.shared_runs(root)


@shared_run("ft_reference")
def ft_reference(root):
  """tests/workers/ft_common.py: the fault-tolerance job run uninterrupted to its end."""
  from tests.workers import ft_common  # pylint: disable=g-import-not-at-top
  return ft_common.reference_run(root)
