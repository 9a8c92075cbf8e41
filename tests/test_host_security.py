"""Another user of the host can neither plant, redirect nor read the local tier, nor read the backups.

A second, unprivileged user (made with `useradd` when the tests run as
root; skipped otherwise) plants the predictable places before the tier
starts: the per-user root and a job's directory, as symlinks to a folder
of hers and as world-writable directories. Each is refused with one line,
a sentinel outside the tier keeps its bytes and mtime, and after a save of
both tiers she can open none of their files for reading.
"""

import os
import pwd
import stat
import subprocess
import sys
import tempfile

import pytest

from tests import tier_runs
from tests.conftest import launch_workers
from tfdp import errors
from tfdp.checkpoint.format import fs
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import private
from tfdp.checkpoint.local import slots

STRANGER = "tfdp-stranger"
# Her Python: the system's (she cannot be expected to read a checkout's venv).
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


@pytest.fixture(scope="module")
def stranger():
  """(uid, gid) of a second local user, made if missing."""
  if os.geteuid() != 0:
    pytest.skip("needs root: the test makes a second local user (useradd) and acts as her")
  try:
    entry = pwd.getpwnam(STRANGER)
  except KeyError:
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                           STRANGER], capture_output=True, check=False)
    if made.returncode not in (0, 9):  # 9: made meanwhile by a concurrent test.
      pytest.skip(f"useradd {STRANGER} failed: {made.stderr.decode()[-200:]}")
    entry = pwd.getpwnam(STRANGER)
  return entry.pw_uid, entry.pw_gid


def _as(user, code, *args):
  """Runs Python `code` (argv: `args`) as `user`; returns its stdout."""
  uid, gid = user
  proc = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                         PYTHON, "-c", code, *args], capture_output=True, check=False,
                        env={"PATH": "/usr/bin:/bin"}, cwd="/")
  assert proc.returncode == 0, proc.stderr.decode()
  return proc.stdout.decode()


_PLANT = """
import os, sys
kind, path, target = sys.argv[1:]
if kind == "symlink":
  os.symlink(target, path)
else:
  os.mkdir(path)
  os.chmod(path, 0o777)
"""

_READ = """
import os, sys
for path in sys.argv[1:]:
  try:
    with open(path, "rb") as f:
      f.read(1)
    print("READ", path)
  except OSError as e:
    pass
"""


@pytest.fixture
def shared_place(tmp_path):
  """A folder like /dev/shm (sticky, writable by all), where both users can go."""
  base = tempfile.mkdtemp(prefix="tfdp-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                          else None)
  os.chmod(base, 0o1777)
  yield base
  subprocess.run(["rm", "-rf", base], check=False)


def _her_folder(stranger, shared_place):
  """Her folder in the shared place, with a sentinel file: (folder, sentinel, its (bytes, mtime))."""
  hers = os.path.join(shared_place, "hers")
  _as(stranger, _PLANT, "dir", hers, "")
  sentinel = os.path.join(hers, "sentinel")
  _as(stranger, "import sys; open(sys.argv[1], 'w').write('hers')", sentinel)
  return hers, sentinel, (open(sentinel, "rb").read(), os.stat(sentinel).st_mtime_ns)


def _one_line(e):
  text = str(e.value)
  assert "\n" not in text and ("remove it" in text or "chmod" in text or "choose" in text), text
  return text


@pytest.mark.parametrize("plant", ["root symlink", "root world-writable", "job symlink",
                                   "job world-writable", "root of ours, world-writable",
                                   "folder not sticky"])
def test_a_planted_root_or_job_directory_is_refused_in_one_line(stranger, shared_place, plant,
                                                                monkeypatch):
  """What the stranger pre-creates before the tier starts: refused, and nothing of hers is written."""
  hers, sentinel, before = _her_folder(stranger, shared_place)
  root = os.path.join(shared_place, f"tfdp-{os.geteuid()}")  # The default root's name.
  job = os.path.join(shared_place, "job")  # A local_checkpoint_dir in a shared place.
  if plant == "root symlink":
    _as(stranger, _PLANT, "symlink", root, hers)
  elif plant == "root world-writable":
    _as(stranger, _PLANT, "dir", root, "")
  elif plant == "job symlink":
    _as(stranger, _PLANT, "symlink", job, hers)
  elif plant == "job world-writable":
    _as(stranger, _PLANT, "dir", job, "")
  elif plant == "root of ours, world-writable":
    os.mkdir(root)
    os.chmod(root, 0o777)
  else:
    os.chmod(shared_place, 0o777)  # Anyone may rename what is in it.
  monkeypatch.setattr(layout_lib, "user_local_root", lambda: root)
  monkeypatch.delenv(private.GROUP_ACCESS_ENV, raising=False)
  folder = os.path.join(job if plant.startswith("job") or plant == "folder not sticky" else
                        os.path.join(root, "0123456789abcdef"), "worker-0")
  with pytest.raises(errors.ConfigError) as e:
    fs.make_private_dir(folder)  # What LocalTier.start does first.
  text = _one_line(e)
  assert folder.rsplit("/", 2)[0] in text or shared_place in text, text
  assert (open(sentinel, "rb").read(), os.stat(sentinel).st_mtime_ns) == before
  assert os.listdir(hers) == ["sentinel"]


def test_the_default_root_is_private_to_the_user(tmp_path, monkeypatch):
  """$XDG_RUNTIME_DIR when it is private; else /dev/shm/tfdp-<uid>; made 0700 and checked."""
  xdg = tmp_path / "run"
  xdg.mkdir(mode=0o700)
  monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
  assert layout_lib.user_local_root() == str(xdg / "tfdp")
  assert layout_lib.default_local_root("/some/run").startswith(str(xdg / "tfdp") + "/")
  folder = layout_lib.Layout("/some/run").local(None, 1).directory
  fs.make_private_dir(folder)
  for path in (xdg / "tfdp", os.path.dirname(folder), folder):
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), path
  os.chmod(xdg, 0o755)  # Not private: not used.
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  assert layout_lib.user_local_root() == os.path.join(base, f"tfdp-{os.geteuid()}")
  monkeypatch.setenv(private.GROUP_ACCESS_ENV, "1")
  os.chmod(folder, 0o750)
  fs.make_private_dir(folder)  # Group access asked for: 0750 passes, 0770 does not.
  os.chmod(folder, 0o770)
  with pytest.raises(errors.ConfigError, match="chmod 0750"):
    fs.make_private_dir(folder)


def test_no_file_of_the_tier_is_opened_through_a_symlink(tmp_path):
  """Even inside the private folder (defence in depth): a slot, a record's temp, a kept state."""
  folder = tmp_path / "w"
  folder.mkdir(mode=0o700)
  target = tmp_path / "victim"
  target.write_bytes(b"44 bytes of someone else's file, unchanged.")
  os.symlink(target, folder / "ckpt.slot-0")
  with pytest.raises(OSError):
    slots.Slot(str(folder / "ckpt.slot-0")).fill([])
  os.symlink(target, layout_lib.atomic_tmp_path(str(folder / "record.json")))
  fs.write_atomic(str(folder / "record.json"), "{}")  # The planted temp name is replaced, not followed.
  assert target.read_bytes() == b"44 bytes of someone else's file, unchanged."
  assert stat.S_IMODE(os.stat(folder / "record.json").st_mode) == 0o600


def _walk(top):
  out = []
  for d, dirs, names in os.walk(top):
    out += [os.path.join(d, n) for n in dirs + names]
  return out


def test_the_stranger_can_read_no_file_of_the_tier_or_the_backup(stranger, shared_place, tmp_path,
                                                                 monkeypatch):
  """Both tiers saved (a 2-worker local tier with its kept states, a persistent checkpoint)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv(private.GROUP_ACCESS_ENV, raising=False)
  root = os.path.join(shared_place, f"tfdp-{os.geteuid()}")
  monkeypatch.setattr(layout_lib, "user_local_root", lambda: root)
  run = os.path.join(shared_place, "run")  # The backups, where she may look (0755 above).
  os.mkdir(run, 0o755)
  ckpt = tf.train.Checkpoint(v=tf.Variable([1.0, 2.0]))
  manager = tfdp.CheckpointManager(ckpt, os.path.join(run, "model"), local_checkpoint_every_steps=2)
  manager.save(checkpoint_number=2)
  manager.save_local(2)
  manager.close()  # Waits for both writes.
  tiers, _ = tier_runs.linked_tiers(os.path.join(root, "linked"))  # Kept per-worker states.
  try:
    for tier in tiers:
      tier_runs.save_local(tier, 2)
    assert tiers[0].kept_for_left() == [2]
  finally:
    for tier in tiers:
      tier.close()
  files = [p for p in _walk(root) + _walk(os.path.join(run, "model")) if os.path.isfile(p)]
  assert any(".slot-" in p for p in files) and any("/peer-" in p for p in files)
  assert any(p.endswith(".index") for p in files) and any(".data-" in p for p in files)
  assert _as(stranger, _READ, *files) == ""  # She opened none.
  for path in _walk(root) + _walk(os.path.join(run, "model")):
    if os.path.basename(path) == layout_lib.STATE_FILENAME:
      continue  # TF writes its state file (names only) with the umask; the folder is 0700.
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    assert mode & 0o077 == 0, (path, oct(mode))


@pytest.mark.slow
def test_a_two_worker_job_refuses_a_planted_local_checkpoint_dir_in_one_line(stranger, shared_place,
                                                                             tmp_path):
  """tfdp-train, 2 workers: the local_checkpoint_dir she made a symlink to her folder stops it in one line."""
  hers, sentinel, before = _her_folder(stranger, shared_place)
  job = os.path.join(shared_place, "job")
  _as(stranger, _PLANT, "symlink", job, hers)
  code, out = launch_workers(
      [sys.executable, "-m", "tfdp.cli.train", "--strategy=multi_worker", "--model=cnn",
       "--dataset=synthetic", "--global_batch_size=32", "--num_examples=512",
       "--steps_per_epoch=8", "--seed=1", "--train_steps=4", f"--model_dir={tmp_path / 'm'}",
       f"--local_checkpoint_dir={job}", "--local_checkpoint_every_steps=2"])
  assert code != 0, out[-3000:]
  refused = [l for l in out.splitlines() if "tfdp-train: error:" in l]
  assert refused and all(f"directory {job} is a symbolic link" in l for l in refused), out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  assert (open(sentinel, "rb").read(), os.stat(sentinel).st_mtime_ns) == before
  assert os.listdir(hers) == ["sentinel"]
