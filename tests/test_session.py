"""The test session's own settings (tests/conftest.py): every process the tests start has them, a user's does not."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO, SITE, users_environ

# Stand-ins for TensorFlow and Keras: each says whether the collector ran
# while it was imported.
_FAKE = "import gc\nCOLLECTOR_ON = gc.isenabled()\n"
_REPORT = ("import builtins, gc, json\n"
           "import tensorflow\n"
           "frozen_before_keras = gc.get_freeze_count()\n"
           "import keras\n"
           "print(json.dumps([tensorflow.COLLECTOR_ON, keras.COLLECTOR_ON, gc.isenabled(),\n"
           "                  frozen_before_keras, gc.get_freeze_count() > 0,\n"
           "                  type(builtins.__import__).__name__]))\n")


def _report(tmp_path, env):
  for name in ("tensorflow", "keras"):
    (tmp_path / f"{name}.py").write_text(_FAKE)
  env = dict(env, PYTHONPATH=os.pathsep.join(p for p in [env.get("PYTHONPATH"), str(tmp_path)] if p))
  proc = subprocess.run([sys.executable, "-c", _REPORT], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)


def test_processes_import_tf_and_keras_with_the_collector_paused_then_frozen(tmp_path):
  assert SITE in os.environ["PYTHONPATH"].split(os.pathsep)
  tf_on, keras_on, on_after, frozen_early, frozen, import_type = _report(tmp_path, os.environ)
  assert (tf_on, keras_on) == (False, False)  # paused while each was imported
  assert on_after and frozen_early == 0 and frozen  # frozen once both are loaded, not before
  assert import_type == "builtin_function_or_method"  # the plain import is back


def test_a_users_process_has_none_of_it(tmp_path):
  env = users_environ(os.environ)
  assert "TF_ENABLE_ONEDNN_OPTS" not in env
  assert SITE not in env.get("PYTHONPATH", "").split(os.pathsep)
  tf_on, keras_on, on_after, _, frozen, import_type = _report(tmp_path, env)
  assert (tf_on, keras_on, on_after, frozen) == (True, True, True, False)
  assert import_type == "builtin_function_or_method"


def test_plain_gc_turns_it_off(tmp_path):
  report = _report(tmp_path, dict(os.environ, TFDP_TEST_PLAIN_GC="1"))
  assert report[:3] == [True, True, True] and not report[4]
