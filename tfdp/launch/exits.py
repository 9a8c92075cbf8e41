"""What a worker's exit says: the exit codes the launcher recognises, how an exit reads in the log, which one to blame."""

import signal
from typing import NamedTuple, Optional, Sequence

# Exit codes of workers that the launcher recognises. They equal
# tfdp.liveness.preemption.EXIT_PREEMPTED, tfdp.liveness.heartbeat.EXIT_PEER_LOST and
# tfdp.liveness.stall.EXIT_COLLECTIVE_TIMEOUT (a test checks); they are repeated
# here so that the launcher imports no TensorFlow.
EXIT_PREEMPTED = 75   # saved at a step all workers agreed on; relaunch to resume
EXIT_PEER_LOST = 69   # a worker's peer disappeared; a consequence, not a cause
EXIT_COLLECTIVE_TIMEOUT = 70  # waited past the collective timeout: a worker is stuck


def describe_exit(code: int) -> str:
  """How a worker ended, for the log: `was killed by SIGKILL`, `exited with code 3`, ..."""
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"was killed by {name}"
  if code == EXIT_PREEMPTED:
    return f"was preempted (exit code {code})"
  if code == EXIT_PEER_LOST:
    return f"lost a peer (exit code {code})"
  if code == EXIT_COLLECTIVE_TIMEOUT:
    return f"waited past the collective timeout (exit code {code})"
  return f"exited with code {code}"


class Failure(NamedTuple):
  """What ended a group.

  `kind` is exit, hang or preempted; `slot` is the worker slot to blame,
  `index` its task index, `code` its exit code (None for a hang); `message`
  is the line logged.
  """
  kind: str
  slot: int
  index: int
  code: Optional[int]
  message: str


def first_failure(ended: Sequence[tuple[int, int]]) -> tuple[int, int]:
  """The (index, code) to blame among workers that ended non-zero in the same poll.

  A death by a signal comes first (an outside cause), then other non-zero
  exits, then exits that are consequences of another worker's failure or
  of a signal (EXIT_PEER_LOST, EXIT_PREEMPTED); ties go to the lower index.
  """
  def rank(index_code):
    index, code = index_code
    if code < 0:
      return (0, index)
    return (2 if code in (EXIT_PEER_LOST, EXIT_PREEMPTED) else 1, index)
  return min(ended, key=rank)
