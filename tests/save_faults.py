"""Faults in a save, injected by wrapping the real writer and commit point in the test's (or a worker's) own process.

As PyTorch DCP's tests wrap a StorageWriter: `install(hook)` replaces the
persistent writer's `_write_shards` and `_write_marker` and the format's
`commit` (and with `local`, the local tier's `copies.write`) by wrappers
that call `hook(phase, worker)` at each of PHASES around the real function.
Every commit goes through the one commit point, so a local copy's
during_commit and after_commit reach the hook even without `local`; `local`
adds its earlier phases. The production code has no hook for them.
"""

from collections.abc import Callable
import threading

# The phases of a sharded save, in order (the one place they are named).
PHASES = ("before_shard", "after_shard", "after_marker", "during_commit",
          "after_commit")

Hook = Callable[[str, int], None]


def committer(man) -> int:
  """The worker that commits `man`: a local copy's one writer, else the chief."""
  if man.tier == "local" and len(man.writers) == 1:
    return int(next(iter(man.writers)))
  return 0


def wrappers(hook: Hook, local: bool = False) -> list[tuple[object, str, Callable]]:
  """(module, name, wrapper) of each function `install` replaces, the wrappers calling `hook`."""
  # Not at the top: tests that only name PHASES load no TensorFlow.
  from tfdp.checkpoint.format import commit as commit_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.persistent import writer  # pylint: disable=g-import-not-at-top
  write_shards, write_marker, commit = writer._write_shards, writer._write_marker, commit_lib.commit  # pylint: disable=protected-access

  def _write_shards(job):
    hook("before_shard", job.worker)
    return write_shards(job)

  def _write_marker(job, shards):
    hook("after_shard", job.worker)
    write_marker(job, shards)
    hook("after_marker", job.worker)

  copying = threading.local()  # Set while this thread writes a local copy.

  def _commit(prefix, man, fence=None):
    worker = committer(man)
    if getattr(copying, "on", False):  # A local copy's bytes are in its slot; it has no marker.
      hook("after_shard", worker)
      hook("after_marker", worker)
    hook("during_commit", worker)
    out = commit(prefix, man, fence)
    hook("after_commit", worker)
    return out

  out = [(writer, "_write_shards", _write_shards), (writer, "_write_marker", _write_marker),
         (commit_lib, "commit", _commit)]
  if local:
    from tfdp.checkpoint.local import copies  # pylint: disable=g-import-not-at-top
    from tests.workers import local_faults  # pylint: disable=g-import-not-at-top
    write_copy = local_faults.before_each_copy(lambda worker: hook("before_shard", worker))

    def _write_copy(*args, **kwargs):
      copying.on = True
      try:
        return write_copy(*args, **kwargs)
      finally:
        copying.on = False

    out.append((copies, "write", _write_copy))
  return out


def install(hook: Hook, monkeypatch=None, local: bool = False) -> Callable[[], None]:
  """Makes every save in this process call `hook(phase, worker)` at PHASES; returns what undoes it.

  Args:
    hook: called at each phase; it may raise, wait, or kill the process.
    monkeypatch: pytest's fixture, which then undoes it at the test's end.
    local: also the local tier's copies, at the same points of their write
      (before the slot is filled; once it is, just before the commit).
  """
  replaced = []
  for module, name, wrapper in wrappers(hook, local):
    if monkeypatch is not None:
      monkeypatch.setattr(module, name, wrapper)
    else:
      replaced.append((module, name, getattr(module, name)))
      setattr(module, name, wrapper)

  def undo():
    for module, name, real in replaced:
      setattr(module, name, real)

  return undo
