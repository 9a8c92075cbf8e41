"""The one 2-worker job that test_strategy and test_cluster share; each checks its own part.

A 2-worker launch costs a TensorFlow start per worker and a cluster
handshake; one job (tests/workers/identity_worker.py) does the checks of
both files, and the first test that asks runs it for the whole session.
"""

import functools
import sys

from tests.conftest import launch_workers


@functools.cache
def _run() -> tuple[int, str]:
  return launch_workers([sys.executable, "tests/workers/identity_worker.py"], num_workers=2,
                        timeout=180)


def results(part: str) -> tuple[int, str, list[str]]:
  """The shared job's exit code, its output, and its workers' `RESULT <part>` payloads, sorted.

  Args:
    part: `strategy` or `cluster` (see tests/workers/identity_worker.py).
  """
  code, out = _run()
  marker = f"RESULT {part} "
  return code, out, sorted(l.split(marker, 1)[1] for l in out.splitlines() if marker in l)
