"""Private directories and files on a shared host: owned by this user, 0700/0600, no symlink followed.

The local tier lives in host memory (`/dev/shm`) or a temp dir, places
every user of the host can write. A name there is never trusted: the
tier's root is per user (layout.user_local_root: `$XDG_RUNTIME_DIR/tfdp`
where that is private, else `/dev/shm/tfdp-<uid>`, else the temp dir's), and `ensure_dir`
makes a directory (0700) or checks the one found: owned by the effective
user, no access for others, no symbolic link among the components it owns,
and no ancestor another user can rename (a symlink above it is followed
only when neither it nor its folder belongs to another user). Files are
opened with O_NOFOLLOW and created 0600 (`open_file`), temporary ones with
O_EXCL. TFDP_GROUP_ACCESS=1 lets the user's group read (0750/0640), for a
job whose processes run as users of one group.
"""

import os
import stat

from tfdp import errors
from tfdp.checkpoint.format import layout

GROUP_ACCESS_ENV = "TFDP_GROUP_ACCESS"


def group_access() -> bool:
  """Whether the user asked for group read access (TFDP_GROUP_ACCESS=1)."""
  return os.environ.get(GROUP_ACCESS_ENV, "") not in ("", "0")


def dir_mode() -> int:
  return 0o750 if group_access() else 0o700


def file_mode() -> int:
  return 0o640 if group_access() else 0o600


def _forbidden() -> int:
  """Mode bits a private directory must not have."""
  return 0o027 if group_access() else 0o077


def _mine(uid: int) -> bool:
  return uid in (0, os.geteuid())


def _others_can_rename_in(st) -> bool:
  """Whether a user other than root and us can replace entries of the directory `st`."""
  if not _mine(st.st_uid):
    return True
  return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) and not st.st_mode & stat.S_ISVTX


def _refuse(path: str, problem: str, fix: str) -> errors.ConfigError:
  return errors.ConfigError(f"The local checkpoint tier's directory {path} {problem}: {fix}.")


_ELSEWHERE = "or pass a local_checkpoint_dir of your own"


def _check_owned(path: str, st) -> None:
  if stat.S_ISLNK(st.st_mode):
    raise _refuse(path, f"is a symbolic link (to {os.readlink(path)}), which another user may "
                  "have planted", f"remove it ({path}) {_ELSEWHERE}")
  if not stat.S_ISDIR(st.st_mode):
    raise _refuse(path, "is not a directory", f"remove it {_ELSEWHERE}")
  if st.st_uid != os.geteuid():
    raise _refuse(path, f"belongs to uid {st.st_uid}, not to this process's user "
                  f"({os.geteuid()}), and may have been planted", f"remove it {_ELSEWHERE}")
  if st.st_mode & _forbidden():
    want = "0750 (TFDP_GROUP_ACCESS=1)" if group_access() else "0700"
    raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):04o}: other users could read or "
                  f"plant files in it", f"chmod {want[:4]} {path} {_ELSEWHERE}")


def ensure_dir(path: str, owned_from: str | None = None) -> str:
  """Makes local directory `path` private to this user, or refuses it.

  Components at or below `owned_from` (default: `path` itself), and every
  one this call creates, are this user's: created with `dir_mode()`, else
  checked to be real directories owned by the effective uid with no access
  for others. The components above are followed only when no other user
  can have planted them (see the module docstring).

  Args:
    path: an absolute local path (a relative one is made absolute).
    owned_from: the private root `path` is in (itself or an ancestor).

  Returns:
    `path`, absolute.

  Raises:
    ConfigError: one line: which component is wrong, and how to fix it.
  """
  path = os.path.abspath(path)
  owned_from = os.path.abspath(owned_from or path)
  if path != owned_from and not path.startswith(owned_from.rstrip("/") + "/"):
    raise ValueError(f"{path} is not inside {owned_from}")
  names = [n for n in path.split("/") if n]
  owned_at = len([n for n in owned_from.split("/") if n])
  real, created = "/", False
  for i, name in enumerate(names, 1):
    shown = "/" + "/".join(names[:i])
    nxt = os.path.join(real, name)
    owned = created or i >= owned_at
    try:
      st = os.lstat(nxt)
    except FileNotFoundError:
      try:
        os.mkdir(nxt, dir_mode())
      except FileExistsError:
        pass  # Made meanwhile (another worker of this host, or not): checked below.
      st, owned, created = os.lstat(nxt), True, True
    if owned:
      _check_owned(shown, st)
    else:
      if stat.S_ISLNK(st.st_mode):  # Its folder was checked: only its owner counts.
        if not _mine(st.st_uid):
          raise _refuse(shown, f"is a symbolic link of uid {st.st_uid}, who could point it "
                        "anywhere", f"use a path without it {_ELSEWHERE}")
        nxt = os.path.realpath(nxt)
        st = os.lstat(nxt)
      if not stat.S_ISDIR(st.st_mode):
        raise _refuse(shown, "is not a directory", f"choose another path {_ELSEWHERE}")
      if _others_can_rename_in(st):  # Not a sticky place like /dev/shm: our folder could be swapped.
        raise _refuse(shown, f"can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}, "
                      f"uid {st.st_uid}), who could replace what tfdp makes in it",
                      f"choose a directory only you can write {_ELSEWHERE}")
    real = nxt
  fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
  try:
    same = os.fstat(fd)
  finally:
    os.close(fd)
  if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
    raise _refuse(path, "changed while it was checked", "run again " + _ELSEWHERE)
  return path


def tier_dir(directory: str) -> str:
  """Makes a worker's local-tier folder `directory` (`<root>/worker-i`) private: ensure_dir from its root.

  Under the default root, that root (layout.user_local_root) and everything in
  it is this user's; under a user's local_checkpoint_dir, that directory
  (the folder's parent) and everything in it.
  """
  directory = os.path.abspath(directory)
  root = layout.user_local_root()
  inside = directory.startswith(root.rstrip("/") + "/")
  return ensure_dir(directory, root if inside else os.path.dirname(directory))


def make_dirs(path: str, mode: int | None = None) -> None:
  """Makes local directory `path` and its missing parents, each with `mode` (default `dir_mode()`).

  `os.makedirs` gives its mode to the last folder only: the parents would
  follow the umask (0755), and a run directory made so is the backups' folder.
  """
  path = os.path.abspath(path)
  missing = []
  while not os.path.isdir(path) and os.path.dirname(path) != path:
    missing.append(path)
    path = os.path.dirname(path)
  for folder in reversed(missing):
    try:
      os.mkdir(folder, dir_mode() if mode is None else mode)
    except FileExistsError:
      if not os.path.isdir(folder):
        raise


def open_file(path: str, flags: int, *, exclusive: bool = False) -> int:
  """`os.open` of a tier's file: never through a symlink, created with `file_mode()` (O_EXCL with `exclusive`)."""
  flags |= os.O_NOFOLLOW | os.O_CLOEXEC
  if exclusive:
    flags |= os.O_CREAT | os.O_EXCL
  return os.open(path, flags, file_mode())


def open_tmp(path: str) -> int:
  """A temporary file `path` for writing, made anew (a stale one of a dead process removed first)."""
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass
  return open_file(path, os.O_WRONLY, exclusive=True)
