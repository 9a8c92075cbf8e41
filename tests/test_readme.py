"""The README and docs/ stay true to the code: every tfdp-train flag is documented, the examples run, links resolve."""

import json
import os
import pathlib
import re
import subprocess
import sys

from absl import flags
import pytest

from tests.conftest import REPO, run_all
from tests import shared
from tests.shared import shared_run


def _readme(path="README.md"):
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return f.read()


def test_every_train_flag_is_in_the_flags_table():
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top,unused-import
  documented = set(re.findall(r"^\| `--(\w+)`", _readme("docs/flags.md"), re.M))
  ours = {f.name for f in flags.FLAGS.get_flags_for_module("tfdp.cli.train")}
  assert len(ours) > 10
  assert ours - documented == set(), "flags missing from docs/flags.md"
  assert documented - ours == set(), "docs/flags.md documents flags that do not exist"


def _data_bytes(ckpt_dir, prefix="ckpt-48"):
  return sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in os.listdir(ckpt_dir)
             if f.startswith(prefix + ".data-"))


@shared_run("example_runs")
def example_runs(root):
  """The README's Python example, twice as it is, and twice under `tfdp-launch --num_workers=2`.

  Each pair trains then resumes (the second run finds ckpt-48 and has
  nothing left to train), in its own folder; both pairs at once. Under the
  launcher its manager is built outside the strategy's scope, as TF's
  tutorials build it. Returns {"one": folder, "two": folder, "alone":
  [[code, output], ...], "launched": [...]} (a pair stops at a failure).
  """
  code = re.search(r"```python\n(.*?)```", _readme(), re.S).group(1)
  env = shared.environ(PYTHONPATH=REPO)
  env.pop("TF_CONFIG", None)
  one, two = root / "one_worker", root / "two_workers"
  one.mkdir()
  two.mkdir()
  (two / "example.py").write_text(code)

  def twice(command, cwd):
    runs = []
    for _ in range(2):
      proc = subprocess.run(command, cwd=cwd, env=env, timeout=300, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, check=False)
      runs.append([proc.returncode, proc.stdout.decode("utf-8", errors="replace")])
      if proc.returncode:
        break
    return runs

  alone, launched = run_all([
      lambda: twice([sys.executable, "-c", code], one),
      lambda: twice([sys.executable, "-m", "tfdp.launch", "--num_workers=2", "--",
                     sys.executable, "example.py"], two)])
  return {"one": str(one), "two": str(two), "alone": alone, "launched": launched}


@pytest.mark.slow
def test_python_example_runs_and_resumes(example_runs):
  one, two = pathlib.Path(example_runs["one"]), pathlib.Path(example_runs["two"])
  for code, out in example_runs["alone"]:
    assert code == 0, out[-3000:]
  assert len(example_runs["alone"]) == 2
  assert sorted(f for f in os.listdir(one / "runs" / "example") if f.endswith(".index")) == [
      "ckpt-16.index", "ckpt-32.index", "ckpt-48.index"]

  for code, out in example_runs["launched"]:
    assert code == 0, out[-3000:]
  assert len(example_runs["launched"]) == 2
  # The second run of each pair has nothing left to train, and says so (the chief, once).
  line = "tfdp.fit: the model is at step 48, at or past train_steps=48; nothing to train."
  assert example_runs["alone"][1][1].count(line) == 1, example_runs["alone"][1][1][-3000:]
  assert example_runs["launched"][1][1].count(line) == 1, example_runs["launched"][1][1][-3000:]
  assert line not in example_runs["alone"][0][1] + example_runs["launched"][0][1]
  ckpts = two / "runs" / "example"
  assert sorted(f for f in os.listdir(ckpts) if f.endswith(".index")) == [
      "ckpt-16.index", "ckpt-32.index", "ckpt-48.index"]
  with open(ckpts / "ckpt-48.manifest.json", encoding="utf-8") as f:
    manifest = json.load(f)
  assert manifest["world_size"] == 2
  # 1x the state per save, not one copy per worker.
  assert _data_bytes(ckpts) <= 1.05 * _data_bytes(one / "runs" / "example")


def test_quick_start_commands():
  """The README's test commands are CI's: .ci/run runs `bash scripts/test.sh`, which passes its arguments to pytest."""
  readme = _readme()
  assert "`bash scripts/test.sh`" in readme and '`bash scripts/test.sh -m "not slow"`' in readme
  for path in ("scripts/test.sh", ".ci/run"):
    assert os.path.exists(os.path.join(REPO, path)), path
  with open(os.path.join(REPO, ".ci/run"), encoding="utf-8") as f:
    assert "bash scripts/test.sh" in f.read()
  with open(os.path.join(REPO, "scripts/test.sh"), encoding="utf-8") as f:
    assert re.search(r"-m pytest tests/ .*\"\$@\"", f.read())
  with open(os.path.join(REPO, "setup.cfg"), encoding="utf-8") as f:
    assert re.search(r"^\s+slow: ", f.read(), re.M)  # the marker `-m "not slow"` leaves out


def test_conversion_diff_is_the_examples_diff():
  """The README's diff is `diff -U1` of the two example scripts (test_models runs the converted one)."""
  import difflib  # pylint: disable=g-import-not-at-top
  examples = os.path.join(REPO, "scripts", "examples")
  plain, ours = (open(os.path.join(examples, f), encoding="utf-8").read().splitlines()
                 for f in ("keras_plain.py", "keras_tfdp.py"))
  real = "\n".join(l.rstrip() for l in difflib.unified_diff(plain, ours, lineterm="", n=1)
                   if not l.startswith(("---", "+++")))
  shown = "\n".join(l.rstrip() for l in re.search(
      r"```diff\n(.*?)```", _readme(), re.S).group(1).splitlines())
  assert shown.strip("\n") == real.strip("\n")
  # The strategy comes right after the imports, before any tf.data or model code.
  first_code = next(i for i, l in enumerate(ours) if l and not l.startswith(
      ("import ", "from ", '"""')))
  assert ours[first_code].startswith("strategy = tfdp.make_strategy()"), ours[first_code]


def test_links_between_readme_and_docs_resolve():
  pages = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(
      os.path.join(REPO, "docs")) if f.endswith(".md"))
  assert len(pages) > 5
  slugs = {}
  for page in pages:
    text = re.sub(r"```.*?```", "", _readme(page), flags=re.S)
    slugs[page] = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                   for h in re.findall(r"^#+ (.*)$", text, re.M)}
  for page in pages:
    text = re.sub(r"```.*?```", "", _readme(page), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"\w+://", target):
        continue
      path, _, anchor = target.partition("#")
      resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
      assert os.path.exists(os.path.join(REPO, resolved)), (page, target)
      if anchor and resolved.endswith(".md"):
        assert anchor in slugs[resolved], (page, target, sorted(slugs[resolved]))
