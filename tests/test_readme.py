"""The README and docs/ stay true to the code: every tfdp-train flag is documented, the examples run, links resolve."""

import copy
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


# -- Every command the README shows is run by a test ---------------------------------------------

HERE = "tests/test_readme.py"
USER_PATH = "tests/test_user_path.py"
# Each command the README shows (a line of a ```bash block, a `$ ` line of a
# ```text block, an inline `program args`), as written, under the test that
# runs it: (file, test, a string that file holds where it runs them outside
# this table, [commands]). A command added to the README without a place
# here fails test_every_readme_command_is_run.
RUNS = [
    # Install: the clone, and the import from beside it; the venv and the
    # editable install are scripts/_venv.sh's, which scripts/test.sh (CI)
    # runs before any test; `activate` puts the tools on PATH.
    (HERE, "test_install_lines_leave_no_tfdp_folder_beside_python", '"git", "clone"',
     ["git clone <this repository> tfdp-src && cd tfdp-src",
      "python3 -m venv .venv && .venv/bin/pip install -e .",
      "source .venv/bin/activate",
      'python -c "import tfdp; print(tfdp.__version__)"']),
    # Run, kill, run again: keras_tfdp.py under tfdp-launch on 2 workers,
    # worker 1 SIGKILLed, the same command again (fewer, smaller epochs).
    (USER_PATH, "test_readme_example_changes_five_lines_and_resumes_under_tfdp_launch",
     '"keras_tfdp.py"',
     ["tfdp-launch --num_workers=2 -- python scripts/examples/keras_tfdp.py --epochs=3 "
      "--num_examples=16384 --backup_dir=/tmp/backup",
      "kill -9 <pid of worker 1>", "kill -9"]),
    # tfdp-train: parsed here as both tools parse it; tfdp-train under
    # tfdp-launch --max_restarts, SIGKILLed 5 times, runs in the chaos test.
    (HERE, "test_tfdp_train_command_parses", "cli.parse(",
     ["tfdp-launch --num_workers=2 --max_restarts=3 -- tfdp-train --model=resnet20 "
      "--dataset=synthetic --global_batch_size=128 --train_steps=2000 "
      "--checkpoint_every_steps=200 --async_checkpoint --model_dir=runs/a"]),
    # The Python example, alone and under tfdp-launch, twice each.
    (HERE, "test_python_example_runs_and_resumes", '"tfdp.launch", "--num_workers=2"',
     ["tfdp-launch --num_workers=2 -- python example.py"]),
    # tfdp-ckpt on the Python example's checkpoints.
    (HERE, "test_tfdp_ckpt_commands_on_the_example", '"tfdp-ckpt")',
     ["tfdp-ckpt ls runs/example", "tfdp-ckpt verify runs/example/ckpt-48",
      "tfdp-ckpt inspect runs/example/ckpt-48", "tfdp-ckpt export runs/example/ckpt-48 out/"]),
    # On a cluster: the ray extra is in the test extra, with which test_ray
    # runs Ray Train (tests/workers/ray_fit.py, ray_keras.py's model).
    (HERE, "test_the_ray_extra_is_what_test_ray_runs_with", '"ray_fit.py"',
     ['pip install "tfdp[ray]"']),
    # The quick start: scripts/demo.sh's set-up and its job, parsed as both
    # tools parse it; tfdp-train under tfdp-launch runs in the chaos test.
    (HERE, "test_demo_sets_up_and_runs_the_main_job", '"scripts", "demo.sh"',
     ["bash scripts/demo.sh"]),
    # Tests: the suite itself (.ci/run), and its fast tier.
    (HERE, "test_quick_start_commands", '"setup.cfg"',
     ["bash scripts/test.sh", 'bash scripts/test.sh -m "not slow"']),
]
RUN_BY = {command: (path, test, where) for path, test, where, commands in RUNS
          for command in commands}
# Programs whose inline `program args` in the README's prose is a command.
PROGRAMS = ("bash", "cd", "git", "kill", "mv", "pip", "python", "python3", "rm", "source",
            "tfdp-ckpt", "tfdp-launch", "tfdp-train", "uv")


def _readme_commands(text):
  """The commands `text` shows: [(kind, command)], kind "bash", "text", "inline" or "block:LANG"."""
  commands = []
  for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
    if lang == "bash":
      for line in body.replace("\\\n", " ").splitlines():
        line = re.split(r"\s+#\s", line)[0]
        if line.strip():
          commands.append(("bash", " ".join(line.split())))
    elif lang == "text":
      commands += [("text", " ".join(re.split(r"\s+#\s", l[2:])[0].split()))
                   for l in body.splitlines() if l.startswith("$ ")]
    else:
      commands.append((f"block:{lang}", body))
  prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  commands += [("inline", c) for c in re.findall(r"`([^`\n]+)`", prose)
               if c.split(" ", 1)[0] in PROGRAMS and " " in c]
  return commands


def test_every_readme_command_is_run():
  commands = _readme_commands(_readme())
  blocks = sorted(kind for kind, _ in commands if kind.startswith("block:"))
  # The diff (test_conversion_diff_is_the_examples_diff) and the Python
  # example (example_runs) are the only other blocks.
  assert blocks == ["block:diff", "block:python"], blocks
  shown = {c for kind, c in commands if not kind.startswith("block:")}
  assert shown - set(RUN_BY) == set(), "README commands that no test runs: add them to RUN_BY"
  assert set(RUN_BY) - shown == set(), "RUN_BY names commands the README no longer shows"
  for path, test, where, commands in RUNS:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
      source = f.read()
    if path == HERE:  # this file, less the table
      source = source[:source.index("RUNS = [")] + source[source.index("RUN_BY = {"):]
    assert re.search(rf"^def {test}\(", source, re.M), (commands, path, test)
    assert where in source, (commands, path, where)


def test_readme_commands_are_found():
  """The finder sees bash lines (continued, without comments), `$ ` lines, and inline commands."""
  text = ("Run `tfdp-ckpt ls d` or `tfdp-train`.\n\n```bash\na --x \\\n  --y  # note\n\n```\n\n"
          "```text\n$ b  # c\nout\n```\n")
  assert _readme_commands(text) == [("bash", "a --x --y"), ("text", "b"),
                                    ("inline", "tfdp-ckpt ls d")]


def _install_lines():
  """The install section's lines, less the quick start's demo (test_demo_sets_up_and_runs_the_main_job)."""
  block = re.search(r"^## Install and quick start\n.*?```bash\n(.*?)```", _readme(), re.S | re.M).group(1)
  lines = [" ".join(re.split(r"\s+#\s", l)[0].split()) for l in block.splitlines()]
  return [l for l in lines if l != "bash scripts/demo.sh"]


def test_install_lines_leave_no_tfdp_folder_beside_python(tmp_path):
  """The README's install: the clone is not named tfdp, and from beside it `import tfdp` is tfdp.

  A clone into ./tfdp, run from its parent, imported the clone as a namespace
  package (the editable install's finder comes after the path's): the last
  check shows it still would.
  """
  clone, venv, activate, check = _install_lines()
  name = re.fullmatch(r"git clone <this repository> (\S+) && cd (\S+)", clone)
  assert name and name.group(1) == name.group(2) != "tfdp", clone
  assert not os.path.exists(os.path.join(REPO, "__init__.py"))  # a clone's root is no package
  if os.path.isdir(os.path.join(REPO, ".git")) or os.path.isfile(os.path.join(REPO, ".git")):
    subprocess.run(["git", "clone", "--quiet", REPO, name.group(1)], cwd=tmp_path, check=True,
                   timeout=120)
    assert os.path.exists(tmp_path / name.group(1) / "setup.cfg")  # what `pip install -e .` reads
  else:  # not a git checkout: the folder the clone would make
    (tmp_path / name.group(1)).mkdir()
  # The venv and its editable install, as scripts/_venv.sh makes the suite's.
  assert venv == "python3 -m venv .venv && .venv/bin/pip install -e .", venv
  with open(os.path.join(REPO, "scripts", "_venv.sh"), encoding="utf-8") as f:
    made = f.read()
  assert '-m venv .venv' in made and 'pip install --quiet -e ".${extras}"' in made
  # `source .venv/bin/activate`: python and the three tools on PATH.
  bin_dir = os.path.dirname(sys.executable)
  assert activate == "source .venv/bin/activate"
  found = subprocess.run(
      ["bash", "-c", activate.replace(".venv/bin", bin_dir) + " && command -v python tfdp-launch "
       "tfdp-train tfdp-ckpt"], cwd=tmp_path, stdout=subprocess.PIPE, check=True, timeout=60,
      env=shared.environ()).stdout.decode().split()
  assert [os.path.dirname(p) for p in found] == [bin_dir] * 4, found
  import tfdp  # pylint: disable=g-import-not-at-top
  env = shared.environ(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
  env.pop("PYTHONPATH", None)
  def from_beside(folder):
    return subprocess.run(["bash", "-c", check], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=60, check=False)
  ran = from_beside(tmp_path)
  assert ran.returncode == 0 and ran.stdout.decode().strip() == tfdp.__version__, ran.stdout
  (tmp_path / "beside_a_tfdp_folder" / "tfdp").mkdir(parents=True)
  ran = from_beside(tmp_path / "beside_a_tfdp_folder")
  assert ran.returncode == 1 and b"AttributeError" in ran.stdout, ran.stdout


def _launched_train(argv):
  """tfdp-launch's arguments `argv` (`... -- tfdp-train ...`) as both tools parse them: (worker, N, options, its flags)."""
  from tfdp.cli import train  # pylint: disable=g-import-not-at-top,unused-import  (defines the flags)
  from tfdp.launch import cli  # pylint: disable=g-import-not-at-top
  worker, num_workers, options = cli.parse(argv)
  mine = copy.deepcopy(flags.FLAGS)  # the process's own flags stay unparsed
  mine(worker)
  return worker, num_workers, options, mine


def test_tfdp_train_command_parses():
  """The README's tfdp-train command, parsed as tfdp-launch and tfdp-train parse it (not run: the chaos test runs one)."""
  import shlex  # pylint: disable=g-import-not-at-top
  command, = (c for c in RUN_BY if " -- tfdp-train " in c)
  argv = shlex.split(command)
  assert argv[0] == "tfdp-launch"
  worker, num_workers, options, mine = _launched_train(argv[1:])
  assert num_workers == 2 and options.max_restarts == 3 and worker[0] == "tfdp-train"
  assert (mine.model, mine.train_steps, mine.async_checkpoint) == ("resnet20", 2000, True)
  with open(os.path.join(REPO, "tests", "test_fault_tolerance.py"), encoding="utf-8") as f:
    assert "max_restarts=5" in f.read()  # tfdp-train under tfdp-launch --max_restarts


def test_demo_sets_up_and_runs_the_main_job():
  """`bash scripts/demo.sh`: the venv set-up CI uses (scripts/_venv.sh), then its job: tfdp-train under tfdp-launch on 2 workers."""
  path = os.path.join(REPO, "scripts", "demo.sh")
  subprocess.run(["bash", "-n", path], check=True, timeout=30)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  assert re.search(r"^source scripts/_venv\.sh\ntfdp_venv ", text, re.M)
  assert '"${JOB[@]}" --train_steps=' in text
  # The job's words, as bash makes them from the script's JOB array.
  job = subprocess.run(
      ["bash", "-c", 'eval "$(sed -n "/^JOB=(/,/)$/p" "$1")"; printf "%s\\n" "${JOB[@]}"', "_", path],
      env=dict(os.environ, MODEL_DIR="runs/demo"), stdout=subprocess.PIPE, check=True, timeout=30,
      text=True).stdout.splitlines()
  assert job[0] == ".venv/bin/tfdp-launch"
  worker, num_workers, _, mine = _launched_train(job[1:] + ["--train_steps=600"])
  assert num_workers == 2 and worker[0] == ".venv/bin/tfdp-train"
  assert (mine.model, mine.strategy, mine.model_dir) == ("cnn", "multi_worker", "runs/demo")


@pytest.mark.slow
def test_tfdp_ckpt_commands_on_the_example(example_runs, monkeypatch, capfd):
  """The README's tfdp-ckpt lines in the folder where the Python example ran.

  `ls` through the installed tool (it needs no TensorFlow); the others
  through the same entry point in this process, whose TensorFlow is loaded.
  """
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  folder = example_runs["one"]
  lines = [c for c in RUN_BY if c.startswith("tfdp-ckpt ")]
  assert [l.split()[1] for l in lines] == ["ls", "verify", "inspect", "export"]
  tool = os.path.join(os.path.dirname(sys.executable), "tfdp-ckpt")
  ls = subprocess.run([tool] + lines[0].split()[1:], cwd=folder, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, timeout=60, check=False, env=shared.environ())
  out = ls.stdout.decode()
  assert ls.returncode == 0 and re.search(r"^ckpt-48 +48 .*sizes ok.*\(latest\)$", out, re.M), out
  entry = next(e for e in metadata.entry_points(group="console_scripts") if e.name == "tfdp-ckpt")
  monkeypatch.chdir(folder)
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1"))  # run() sets it
  outputs = []
  for line in lines[1:]:
    monkeypatch.setattr(sys, "argv", line.split())
    with pytest.raises(SystemExit) as exited:
      entry.load()()
    outputs.append(capfd.readouterr())
    assert exited.value.code == 0, (line, outputs[-1])
  verify, inspect, export = (o.out for o in outputs)
  assert verify.startswith("OK runs/example/ckpt-48: "), verify
  assert re.search(r"^optimizer/iteration ", inspect, re.M), inspect
  assert "to out/" in export and any(f.endswith(".safetensors") for f in os.listdir("out")), export


def test_the_ray_extra_is_what_test_ray_runs_with():
  """`pip install "tfdp[ray]"`: its requirements are in the test extra, so the suite's venv (and test_ray) has them."""
  import configparser  # pylint: disable=g-import-not-at-top
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(REPO, "setup.cfg"))  # What pip installs (an installed venv may be older).
  def extra(name):
    return {r.split("#")[0].replace(" ", "") for r in cfg["options.extras_require"][name].splitlines()
            if r.split("#")[0].strip()}
  assert extra("ray") and extra("ray") <= extra("test"), (extra("ray"), extra("test"))
  with open(os.path.join(REPO, "tests", "test_ray.py"), encoding="utf-8") as f:
    assert "ray_fit.py" in f.read()


def test_readme_is_short():
  """At most 150 lines; its Tests section at most five."""
  readme = _readme()
  assert len(readme.splitlines()) <= 150
  tests = re.search(r"^## Tests\n(.*?)^## ", readme, re.S | re.M).group(1)
  assert 0 < len([l for l in tests.splitlines() if l.strip()]) <= 5, tests
