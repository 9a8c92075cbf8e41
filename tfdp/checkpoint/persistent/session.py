"""A job's session in a checkpoint directory: the id its workers agree on, the chief's lease, cleanup and run token."""

import dataclasses
import hashlib
import os
import re
import time
import uuid

from absl import logging

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.persistent import lease as lease_lib
from tfdp.checkpoint.format import commit as commit_lib

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


# How long a non-chief looks for the chief's lease once the workers agreed:
# the chief took it before the agreement, so where both see the directory
# it is there at once.
VISIBLE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Session:
  """What `start` agreed on.

  Attributes:
    id: the session id, the same on every worker.
    lease: the chief's lease (None on the other workers).
    token: the directory's run token, when the local tier is on ("" otherwise).
    layout: the layout of the directory every worker writes into: the chief's.
    own: the directory this worker was given when it is not the chief's
      (it stays empty), else None.
  """
  id: str
  lease: lease_lib.Lease | None
  token: str = ""
  layout: layout_lib.Layout | None = None
  own: str | None = None

  def keep_own(self) -> None:
    """Makes this worker's own directory again when the user's code removed it after a save.

    As TF's manager does when it writes there: the tutorials remove a
    non-chief's directory after each save.
    """
    if self.own is not None:
      fs.makedirs(self.own)


def _where(directory: str) -> str:
  """`directory` as the other workers can name it: a local path made absolute."""
  return os.path.abspath(directory) if fs.is_local(directory) and "://" not in directory else directory


def _fingerprint(text: str) -> int:
  """48 bits of `text`'s hash: they travel exact through a float64 all-reduce."""
  return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:6], "big")


def _chiefs_directory(me, layout, rows):
  """(the layout every worker writes into, each worker's given directory, this worker's own or None).

  `rows` holds each worker's [flag, fingerprint, bytes] of its directory.
  When a worker was given another directory than the chief's (the TF
  tutorials give each non-chief a temporary one), it writes its part into
  the chief's, and its own stays empty (made, as TF's manager would).
  """
  if len({int(f) for f in rows[:, 1]}) == 1:
    return layout, None, None
  given = cluster.gather_text(_where(layout.directory), int(rows[:, 2].max()), me.strategy)
  chief = given[0]
  others = [w for w in range(1, me.count) if given[w] != chief]
  if me.is_chief:
    logging.info("tfdp: worker(s) %s were given other checkpoint directories (%s) than "
                 "the chief's %s: every worker writes its part into %s, and theirs stay "
                 "empty.", ", ".join(map(str, others)),
                 ", ".join(sorted({given[w] for w in others})), chief, chief)
  if me.index not in others:
    return layout, given, None
  fs.makedirs(layout.directory)
  return layout_lib.Layout(chief, layout.name), given, layout.directory


def _sees_lease(me, layout, session, given):
  """Fails every worker at once when a non-chief does not see the chief's lease."""
  ok = True
  if not me.is_chief:
    try:
      lease_lib.check(layout.lease_path, session, layout.directory, VISIBLE_S)
    except errors.CheckpointError:
      ok = False
  failed = [w for w, seen in enumerate(cluster.gather([float(ok)], me.strategy)[:, 0])
            if not seen]
  if not failed:
    return
  w = failed[0]
  chief = given[0] if given else layout.directory
  was = (f"was given the checkpoint directory {given[w]} and the chief {chief}, and"
         if given and given[w] != chief else f"and the chief were given {chief}, but")
  raise errors.CheckpointError(
      f"Worker {w} {was} worker {w} does not see the chief's lease there (within "
      f"{VISIBLE_S:.0f}s of the chief taking it): give every worker the same "
      "checkpoint directory, one they all see (a shared file system, or a URL "
      "such as gs://).")


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
  """Agrees on this job's session and directory; the chief leases the directory, then cleans it up.

  Nothing is written into the directory before the chief holds its lease:
  the run token of the local tier (with `tiers`) comes after it. With a
  multi-worker strategy the workers agree in one all-reduce, after the
  chief's lease: on the session id, and on the directory (the chief's; see
  _chiefs_directory); a worker that does not see the chief's lease then
  fails every worker at once.

  Args:
    me: this worker.
    layout: the layout of the checkpoint directory this worker was given.
    run_id: an id shared by the workers of this attempt (default: env
      TFDP_RUN_ID); needed only with several workers and no strategy.
    timeout: seconds a worker waits for the chief's lease (and token).
    tiers: the local tier is on: the chief makes the run token, the others
      read it.

  Returns:
    The Session; its layout is the directory to write into.

  Raises:
    CheckpointError: another job holds the directory, or a worker does not
      see the chief's directory (on every worker).
    ConfigError: several workers, no strategy and no run id.
  """
  session, nonce = _session_id(me, run_id)
  agreeing = me.count > 1 and me.strategy is not None
  lease, token, failure = None, "", None
  if me.is_chief:
    try:
      fs.makedirs(layout.directory)
      lease = lease_lib.acquire(layout.lease_path, session, layout.directory)
      commit_lib.cleanup(layout, session)
      if tiers:
        token = ensure_token(layout)
    except Exception as e:  # pylint: disable=broad-except
      if not agreeing:
        raise
      failure = e  # The other workers wait in the agreement: a 0 fails them too.
  own = None
  if agreeing:
    # The all-reduce completes only after the chief's lease and cleanup, so
    # no worker writes into a directory that is being cleaned. The chief
    # sends nonce + 1 (1 with a run id), so that 0 means it failed.
    flag = (nonce + 1 if nonce is not None else 1) if me.is_chief and failure is None else 0
    where = _where(layout.directory)
    rows = cluster.gather([flag, _fingerprint(where), len(where.encode("utf-8"))], me.strategy)
    if failure is not None:
      raise failure
    total = int(rows[:, 0].max())
    if total == 0:
      raise errors.CheckpointError(
          f"The chief could not start checkpointing into {layout.directory} "
          "(the chief's error says why).")
    if nonce is not None:
      session = f"{total - 1:012x}"
    layout, given, own = _chiefs_directory(me, layout, rows)
    _sees_lease(me, layout, session, given)
  elif not me.is_chief:
    lease_lib.check(layout.lease_path, session, layout.directory, timeout)
  if tiers and not me.is_chief:
    token = read_token(layout, timeout)
  return Session(session, lease, token, layout, own)
