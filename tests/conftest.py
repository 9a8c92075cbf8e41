"""Shared test set-up: quiet TF logs, two logical CPUs in-process, real multi-worker runners, shared runs started early."""

import concurrent.futures
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top

from tests import shared  # pylint: disable=g-import-not-at-top
from tests.shared import shared_run  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def pytest_configure(config):
  # In-process tests mirror over 2 logical CPUs; this must happen before TF
  # initialises its devices, i.e. before any test creates a tensor.
  from tfdp import strategy  # pylint: disable=g-import-not-at-top
  strategy.configure_cpu_replicas(2)


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
