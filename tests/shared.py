"""Runs that several tests share: each made once per pytest session, started early in a thread of its own."""

import contextlib
import fcntl
import json
import os
import shutil
import threading
import warnings

import pytest

# A `shared_run` is made once per session by whichever asks first: the
# fixture of a test that needs it, or the thread that `early` starts with
# the session, which makes them in the order the tests first use them.
# That thread's processes take the core that the tests before their users
# leave idle (a test of one process leaves one of two cores idle); on a
# busy host they share the CPU as the tests' own processes do.
_MAKERS = {}  # fixture name -> maker(tmp_path_factory)
# The environment as the session started: the processes of shared runs get
# it, not one a test has monkeypatched meanwhile (their thread runs beside the tests).
_SESSION_ENV = dict(os.environ)


def environ(**extra):
  """A copy of the environment as the session started (see _SESSION_ENV), updated with `extra`."""
  return dict(_SESSION_ENV, **extra)


def once_per_session(tmp_path_factory, name, make):
  """`make(folder)`'s result (JSON), made once per session under basetemp/`name`; one maker at a time.

  A maker that raises keeps nothing: the next caller makes it again, in an empty folder.
  """
  root = tmp_path_factory.getbasetemp() / name
  root.mkdir(exist_ok=True)
  done = root / "result.json"
  with open(root / "lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      folder = root / "run"
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      done.write_text(json.dumps(make(folder)))
  return json.loads(done.read_text())


def shared_run(name):
  """Decorator: `make(root)` -> JSON-able becomes session fixture `name`, made once, started early.

  Returns:
    The fixture: a module-level name in a test file or conftest.py.
  """
  def decorate(make):
    def maker(tmp_path_factory):
      return once_per_session(tmp_path_factory, name, make)

    maker.name = name
    # By file: pytest may import conftest.py twice, as conftest and tests.conftest.
    maker.made_by = f"{os.path.abspath(make.__code__.co_filename)}:{make.__qualname__}"
    other = _MAKERS.setdefault(name, maker)
    if other.made_by != maker.made_by:  # one basetemp folder and fixture name each
      raise ValueError(f"shared run {name!r} is made by both {other.made_by} and {maker.made_by}")

    @pytest.fixture(scope="session", name=name)
    def fixture(tmp_path_factory):
      return maker(tmp_path_factory)

    fixture.__doc__ = make.__doc__
    return fixture
  return decorate


@contextlib.contextmanager
def early(items, tmp_path_factory):
  """While in this context, a thread makes the shared runs that `items` (the selected tests) use."""
  first_use = {}
  for i, item in enumerate(items):
    for name in getattr(item, "fixturenames", ()):
      first_use.setdefault(name, i)
  makers = [_MAKERS[name] for name in sorted(set(_MAKERS) & set(first_use), key=first_use.get)]
  # The session's basetemp made here, before the thread: pytest makes it on
  # first use, unlocked, and a test that asks for tmp_path while the thread
  # asks too got a second basetemp, whose shared runs were made again (seen
  # in runs of one file: the ft_reference and matrix runs made twice).
  tmp_path_factory.getbasetemp()
  stop = threading.Event()

  def make_them():
    for maker in makers:
      if stop.is_set():
        return
      try:
        maker(tmp_path_factory)
      except Exception as e:  # pylint: disable=broad-except
        # Nothing is kept: the fixture makes it again, and its test says why.
        warnings.warn(f"shared run {maker.name} failed early ({e!r}); its fixture makes it again")

  thread = threading.Thread(target=make_them, name="early-runs", daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()  # No process of it outlives the session.
