"""The agreed restore from one checkpoint directory: the newest intact candidate, what is corrupt set aside, the values put back."""

import dataclasses
import os
import time

from absl import logging
import tensorflow as tf

from tfdp.distribute import cluster
from tfdp import errors
from tfdp.checkpoint.persistent import catalog as catalog_lib
from tfdp.checkpoint.format import items as items_lib
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint import model_match
from tfdp.checkpoint.format import commit as commit_lib
# Through the module: tests wrap its functions (a read that fails) in place.
from tfdp.checkpoint import restore as restore_lib

# One worker's outcome of a restore in an agreement. CORRUPT: a file is
# damaged (set aside); UNREADABLE: a read error (left as it is); REFUSED:
# before_restore raised, or it is no checkpoint of this model (raised).
OK, CORRUPT, UNREADABLE, REFUSED = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore restored: its prefix, manifest (None: TF's own) and tier."""
  prefix: str
  manifest: manifest_lib.Manifest | None
  tier: str  # "persistent", "local" (each worker's own copy) or "peer".


class Restorer:
  """Restores from one checkpoint directory: intact candidates, the verified read, per-worker state, set aside.

  Args:
    checkpoint: the `tf.train.Checkpoint` to restore into.
    layout: the directory's layout.
    catalog: the directory's `tfdp.checkpoint.persistent.catalog.Catalog`.
    me: this worker (`tfdp.distribute.cluster.Worker`).
    per_worker: a `tf.train.Checkpoint` of this worker's per-worker state, or None.
    verify_sizes: check every file's size before a restore reads it.
    lease: the chief's `tfdp.checkpoint.persistent.lease.Holder`: it holds the lease
      before it sets a checkpoint aside.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, layout, catalog, me,
               per_worker: tf.train.Checkpoint | None, verify_sizes: bool, lease):
    self._checkpoint = checkpoint
    self._layout = layout
    self._catalog = catalog
    self._me = me
    self._per_worker = per_worker
    self._verify = verify_sizes
    self._lease = lease
    self.applied = False  # A restore of newest_intact changed this worker's state.
    # How a checkpoint of another model is met (`check_model`), set by the manager.
    self.require_all = False
    self.allow_partial = False
    self._initial = None  # What the state was before the first restore that changed it.

  def candidates(self):
    """Yields (prefix, manifest) of the checkpoints, newest first (nothing checked yet)."""
    for prefix in self._catalog.candidates():
      yield prefix, self._catalog.manifest(prefix)

  def newest_step(self) -> int | None:
    """The step of the newest checkpoint whose files are all there, or None (nothing is set aside)."""
    for prefix, man in self.candidates():
      if self._verify:
        try:
          restore_lib.check_sizes(prefix, man)
        except errors.CorruptCheckpointError:
          continue
      return man.step if man is not None else layout_lib.number_of(prefix)
    return None

  def restore(self, prefix: str):
    """Verifies and restores `prefix` and this worker's per-worker state.

    Returns:
      (TF's load status, the manifest or None for TF's own checkpoint).

    Raises:
      CorruptCheckpointError: a file is missing, truncated or corrupt (the
        checkpoint is then set aside).
    """
    man = self._catalog.manifest(prefix)
    try:
      restore_lib.check_manifest(prefix, man)
      if self._verify:
        restore_lib.check_sizes(prefix, man)
      status = self._restore_checked(prefix, man)
    except errors.CorruptCheckpointError as e:
      raise self.set_aside(prefix, e) from e
    finally:
      self.settle()
    return status, man

  def _restore_checked(self, prefix: str, man):
    """Restores `prefix` and this worker's per-worker state, once it is known to be of this model (`check_model`)."""
    match = self.check_model(prefix)
    self.before_apply()
    if match.exact:
      status = restore_lib.restore_verified(self._checkpoint, prefix, man)
    else:
      restore_lib.restore_matched(self._checkpoint, prefix, man, match)
      status = None
    self.restore_per_worker(prefix, man)
    return status

  def check_model(self, prefix: str) -> model_match.ModelMatch:
    """`check_model` with this restorer's settings; the chief names what a partial restore leaves."""
    match = model_match.check_model(self._checkpoint, prefix, self.require_all,
                                    self.allow_partial)
    if match.differences and self._me.is_chief:
      logging.warning("tfdp: restoring what matches of %s (allow_partial_restore); not "
                      "restored: %s.", prefix, "; ".join(match.differences))
    return match

  def restore_per_worker(self, prefix: str, man, reader=None) -> None:
    """This worker's own per-worker state from `prefix` (nothing when there is none)."""
    if self._per_worker is not None:
      restore_lib.restore_per_worker(self._per_worker, prefix, self._me.index, man, reader)

  def newest_intact(self, before_restore=None, tried: list | None = None) -> Restored | None:
    """Restores the newest checkpoint every worker can restore, agreed by all; None when there is none.

    Every worker must call it. In each round the workers agree (one
    all-reduce) on the newest checkpoint all of them list; each checks its
    file sizes, calls `before_restore` and restores it; a second all-reduce
    of the outcomes decides. When any worker failed, every worker moves to
    the next older one together: one found damaged is set aside by the
    chief after the agreement (no worker still reads it); one that could
    not be read (a transient error) is left as it is, and if no older one
    can be restored either, every worker raises rather than start over.

    Args:
      before_restore: optional `fn(prefix)` called before each restore; its
        exceptions propagate (on every worker).
      tried: a list to append what failed to.

    Raises:
      CheckpointError: nothing could be read, or nothing to restore but the
        directory holds checkpoints nothing accounts for (see
        Catalog.check_nothing_unknown).
    """
    bound, unreadable = None, []
    while True:
      mine = [(catalog_lib.number_of(p), p, m) for p, m in self.candidates()]
      mine = [c for c in mine if bound is None or c[0] < bound]
      # number + 2: TF's own checkpoints without a number are -1, none is 0.
      agreed = int(cluster.agree(mine[0][0] + 2 if mine else 0, "min", self._me.strategy)) - 2
      if agreed < -1:
        break
      found = next(((p, m) for n, p, m in mine if n == agreed), None)
      outcome, error = self._attempt(found, before_restore)
      codes = [int(c) for c in cluster.gather([outcome], self._me.strategy)[:, 0]]
      if max(codes) == OK:
        return Restored(found[0], found[1], "persistent")
      if max(codes) == REFUSED:
        if outcome == REFUSED:
          raise error
        raise errors.CheckpointError(
            "Another worker refused the checkpoint to restore (its log says why).")
      failed = [w for w, c in enumerate(codes) if c != OK]
      name = os.path.basename(found[0]) if found else f"number {agreed}"
      if found is not None and CORRUPT in codes:
        damaged = [w for w, c in enumerate(codes) if c == CORRUPT]
        if outcome == CORRUPT:
          why = _first_line(error)
          if not self._me.is_chief:  # The chief's one line says it (recovery.restore_newest).
            logging.warning("tfdp: %s", why)
        else:
          why = f"worker(s) {damaged} found it damaged (their logs name the file)"
        self.set_aside(found[0], error or errors.CorruptCheckpointError(why))
        what = f"persistent {name} (set aside: {why})"
      else:
        if found is not None:
          self._catalog.abandon(found[0])
          unreadable.append(name)
        what = f"persistent {name} (failed on worker(s) {failed})"
      if tried is not None:
        tried.append(what)
      bound = agreed
    if unreadable:
      raise errors.CheckpointError(
          f"{', '.join(unreadable)} in {self._layout.directory} could not be read by every "
          "worker (their logs say why) and nothing older could be restored: not starting "
          "over next to them. Run the job again once the storage is readable.")
    self._catalog.check_nothing_unknown()
    return None

  def _attempt(self, found, before_restore):
    """This worker's part of one round: (OK, None), or (CORRUPT | UNREADABLE | REFUSED, the error).

    A read error that proves no damage (a transient I/O error) is retried
    (restore_lib.READ_RETRIES) before the checkpoint is given up.
    """
    if found is None:
      return UNREADABLE, errors.CheckpointError("this worker does not list it")
    prefix, man = found
    for wait in restore_lib.READ_RETRIES + (None,):
      outcome, error = self._attempt_once(prefix, man, before_restore)
      if outcome != UNREADABLE or wait is None:
        return outcome, error
      logging.warning("tfdp: could not read %s on this worker (%s); trying again in %.1f s.",
                      prefix, error, wait)
      time.sleep(wait)
    raise AssertionError("unreachable")

  def _attempt_once(self, prefix, man, before_restore):
    try:
      restore_lib.check_manifest(prefix, man)
      if self._verify:
        restore_lib.check_sizes(prefix, man)
      if before_restore is not None:
        try:
          before_restore(prefix)
        except Exception as e:  # pylint: disable=broad-except
          return REFUSED, e
      self._restore_checked(prefix, man)
      return OK, None
    except errors.CorruptCheckpointError as e:
      return CORRUPT, e  # Set aside after the agreement, with a warning.
    except restore_lib.UNREADABLE_ERRORS as e:
      return UNREADABLE, e
    except Exception as e:  # pylint: disable=broad-except
      return REFUSED, e

  def before_apply(self) -> None:
    """Called before a restore may change the state: keeps what it is now, once, for `put_back`."""
    if self._initial is None:
      self._initial = InitialState(self._checkpoint)
    self.applied = True  # From here on the state may be changed, even if it fails.

  def settle(self) -> None:
    """Once a restore is done with: drops the state kept for `put_back` (it holds the old values' buffers)."""
    self._initial, self.applied = None, False

  def put_back(self) -> bool:
    """After failed restores: gives the state the values it had before them; False when it cannot.

    A fresh start after a failed attempt then starts from the same state
    as one that never tried (the model's initial values, on every worker).
    """
    if self._initial is None:
      return True
    done = self._initial.put_back()
    self._initial, self.applied = None, not done
    return done

  def set_aside(self, prefix: str, error: Exception) -> Exception:
    """Takes corrupt checkpoint `prefix` out of the managed ones; returns the error to raise.

    Its manifest becomes `<prefix>.manifest.json.corrupt` (a marker when it
    has none), so a restart does not try it again and training can save past
    its number; its data files go with the next manager's cleanup.
    """
    latest = self._catalog.drop(prefix)
    if latest is False:
      return error
    if self._me.is_chief:
      try:
        self._lease.ensure()
        self._lease.check()  # Fencing: never in a directory another job holds.
        commit_lib.set_aside(prefix, str(error))
        catalog_lib.write_state(self._layout, self._catalog)
      except tf.errors.OpError as e:
        logging.warning("tfdp: could not set aside %s: %s", prefix, e)
    return errors.CorruptCheckpointError(
        f"{str(error).rstrip('.')}. It is no longer a committed checkpoint (set aside as "
        f"{layout_lib.corrupt_path(prefix)}); the newest intact one is {latest}.")


def _first_line(error: Exception) -> str:
  """The first line of `error`'s message, at most 400 characters (what the chief's one line says of it)."""
  text = (str(error).splitlines() or [type(error).__name__])[0]
  return text if len(text) <= 400 else text[:397] + "..."


class InitialState:
  """A checkpoint's values before a restore, to put back when every restore failed after changing some.

  Taken without a copy: the tensors alias the variables' buffers, and TF
  copies a buffer before a restore writes it while they hold it (on a
  GPU they hold device memory until dropped).

  Args:
    checkpoint: the `tf.train.Checkpoint`.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint):
    checkpoint.save_counter  # pylint: disable=pointless-statement  (made before it is kept)
    self._checkpoint = checkpoint
    self._items = items_lib.gather(checkpoint, with_object_graph=False)

  def put_back(self) -> bool:
    """Assigns the kept values; False (nothing assigned) when the objects cannot take them so (sliced)."""
    if any(it.slice_spec for it in self._items):
      return False
    values = {it.key: it.value.numpy() for it in self._items}
    return items_lib.restore_values(self._checkpoint, values)
