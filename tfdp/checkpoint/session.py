"""A job's session in a checkpoint directory: the id its workers agree on, the chief's lease, cleanup and run token."""

import dataclasses
import os
import re
import time
import uuid

from tfdp import cluster
from tfdp import errors
from tfdp.checkpoint import fs
from tfdp.checkpoint import layout as layout_lib
from tfdp.checkpoint import lease as lease_lib
from tfdp.checkpoint import storage

RUN_ID_ENV = "TFDP_RUN_ID"


def ensure_token(layout: layout_lib.Layout) -> str:
  """The persistent directory's run token, made by the chief when the directory has none.

  Local checkpoints record it: when the persistent directory is emptied or
  replaced (a new run in the same place), it gets a new token and the local
  copies of the old run, which may still sit in host memory, are ignored.
  """
  found = fs.read_json(layout.tiers_path)
  if found is not None:
    return found["token"]
  token = uuid.uuid4().hex
  fs.write_json_atomic(layout.tiers_path, {"token": token, "time": time.time()})
  return token


def read_token(layout: layout_lib.Layout, timeout: float) -> str:
  """The run token the chief made (see ensure_token), waiting up to `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while True:
    found = fs.read_json(layout.tiers_path)
    if found is not None:
      return found["token"]
    if time.monotonic() > deadline:
      raise errors.CheckpointError(
          f"{layout.tiers_path} did not appear within {timeout:.0f}s: the chief "
          "did not start its checkpoint manager with the local tier. Every "
          "worker must pass the same local_checkpoint_every_steps.")
    time.sleep(0.05)


@dataclasses.dataclass(frozen=True)
class Session:
  """What `start` agreed on.

  Attributes:
    id: the session id, the same on every worker.
    lease: the chief's lease (None on the other workers).
    token: the directory's run token, when the local tier is on ("" otherwise).
  """
  id: str
  lease: lease_lib.Lease | None
  token: str = ""


def _session_id(me, run_id):
  """(this worker's session id, the nonce the workers agree on or None)."""
  if me.count == 1:
    return uuid.uuid4().hex[:12], None
  run_id = run_id if run_id is not None else os.environ.get(RUN_ID_ENV)
  if run_id is not None:
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(run_id)), None
  if me.strategy is not None:
    # The chief's nonce wins the agreement (see start), so its id is final.
    nonce = int.from_bytes(os.urandom(6), "big")
    return f"{nonce:012x}", nonce
  raise errors.ConfigError(
      f"With num_workers={me.count} and no MultiWorkerMirroredStrategy, "
      f"pass run_id= (or set env {RUN_ID_ENV}) to the same value on "
      "every worker, new for each attempt of the job.")


def start(me: cluster.Worker, layout: layout_lib.Layout, run_id: str | None,
          timeout: float, tiers: bool = False) -> Session:
  """Agrees on this job's session; the chief leases the directory, then cleans it up.

  Nothing is written into the directory before the chief holds its lease:
  the run token of the local tier (with `tiers`) comes after it.

  Args:
    me: this worker.
    layout: the checkpoint directory's layout.
    run_id: an id shared by the workers of this attempt (default: env
      TFDP_RUN_ID); needed only with several workers and no strategy.
    timeout: seconds a worker waits for the chief's lease (and token).
    tiers: the local tier is on: the chief makes the run token, the others
      read it.

  Returns:
    The Session.

  Raises:
    CheckpointError: another job holds the directory (on every worker).
    ConfigError: several workers, no strategy and no run id.
  """
  session, nonce = _session_id(me, run_id)
  lease, token = None, ""
  if me.is_chief:
    try:
      fs.makedirs(layout.directory)
      lease = lease_lib.acquire(layout.lease_path, session, layout.directory)
      storage.cleanup(layout, session)
      if tiers:
        token = ensure_token(layout)
    except Exception:
      if nonce is not None:  # The other workers wait in the agreement: 0 fails them too.
        cluster.agree(0, "max", me.strategy)
      raise
  if nonce is not None:
    # The all-reduce completes only after the chief's lease and cleanup, so
    # no worker writes into a directory that is being cleaned. The chief
    # sends nonce + 1, so that 0 means it failed.
    total = int(cluster.agree(nonce + 1 if me.is_chief else 0, "max", me.strategy))
    if total == 0:
      raise errors.CheckpointError(
          f"The chief could not start checkpointing into {layout.directory} "
          "(the chief's error says why).")
    session = f"{total - 1:012x}"
  if not me.is_chief:
    lease_lib.check(layout.lease_path, session, layout.directory, timeout)
    if tiers:
      token = read_token(layout, timeout)
  return Session(session, lease, token)
