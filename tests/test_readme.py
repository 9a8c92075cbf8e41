"""The README stays true to the code: every tfdp-train flag is documented, the quick start exists."""

import os
import re

from absl import flags

from tests.conftest import REPO


def _readme():
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_every_train_flag_is_in_the_flags_table():
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top,unused-import
  documented = set(re.findall(r"^\| `--(\w+)`", _readme(), re.M))
  ours = {f.name for f in flags.FLAGS.get_flags_for_module("tfdp.cli.train")}
  assert len(ours) > 10
  assert ours - documented == set(), "flags missing from README"
  assert documented - ours == set(), "README documents flags that do not exist"


def test_quick_start_commands():
  readme = _readme()
  assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
  for path in ("scripts/demo.sh", "scripts/test.sh", ".ci/run"):
    assert os.path.exists(os.path.join(REPO, path)), path
  with open(os.path.join(REPO, ".ci/run"), encoding="utf-8") as f:
    assert "bash scripts/test.sh" in f.read()
