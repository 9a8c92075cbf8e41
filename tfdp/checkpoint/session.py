"""A job's session in a checkpoint directory: the id its workers agree on, the chief's lease and cleanup."""

import os
import re
import uuid

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import lease as lease_lib
from tfdp.checkpoint import storage

RUN_ID_ENV = "TFDP_RUN_ID"


def start(me: cluster.Worker, layout: layout_lib.Layout, run_id: str | None,
          timeout: float) -> tuple[str, lease_lib.Lease | None]:
  """Agrees on this job's session; the chief leases the directory and cleans it up.

  Args:
    me: this worker.
    layout: the checkpoint directory's layout.
    run_id: an id shared by the workers of this attempt (default: env
      TFDP_RUN_ID); needed only with several workers and no strategy.
    timeout: seconds a worker waits for the chief's lease.

  Returns:
    (session id, the chief's lease or None on the other workers).

  Raises:
    CheckpointError: another job holds the directory (on every worker).
    ConfigError: several workers, no strategy and no run id.
  """
  agreed = None
  if me.count == 1:
    session = uuid.uuid4().hex[:12]
  else:
    run_id = run_id if run_id is not None else os.environ.get(RUN_ID_ENV)
    if run_id is not None:
      session = re.sub(r"[^A-Za-z0-9_.]", "_", str(run_id))
    elif me.strategy is not None:
      nonce = int.from_bytes(os.urandom(6), "big")
      session, agreed = f"{nonce:012x}", nonce
    else:
      raise errors.ConfigError(
          f"With num_workers={me.count} and no MultiWorkerMirroredStrategy, "
          f"pass run_id= (or set env {RUN_ID_ENV}) to the same value on "
          "every worker, new for each attempt of the job.")
  lease = None
  if me.is_chief:
    try:
      fs.makedirs(layout.directory)
      lease = lease_lib.acquire(layout.lease_path, session, layout.directory)
      storage.cleanup(layout, session)
    except Exception:
      if agreed is not None:  # The other workers wait in the agreement: 0 fails them too.
        cluster.agree(0, "max", me.strategy)
      raise
  if agreed is not None:
    # The all-reduce completes only after the chief's lease and cleanup, so
    # no worker writes into a directory that is being cleaned. The chief
    # sends nonce + 1, so that 0 means it failed.
    total = int(cluster.agree(agreed + 1 if me.is_chief else 0, "max", me.strategy))
    if total == 0:
      raise errors.CheckpointError(
          f"The chief could not start checkpointing into {layout.directory} "
          "(its log says why, e.g. another job holds the directory).")
    session = f"{total - 1:012x}"
  if not me.is_chief:
    lease_lib.check(layout.lease_path, session, layout.directory, timeout)
  return session, lease
