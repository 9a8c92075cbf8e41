"""The shape of the package: modules of one screenful or a few, imports that only run down, save() on one screen."""

import ast
import inspect
import os

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "tfdp")
MAX_LINES = 500


def _modules():
  """{dotted name: path} of every module of tfdp."""
  found = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        found[name.removesuffix(".__init__")] = path
  return found


def _imports(modules):
  """{module: the tfdp modules it imports}, at any depth of its code (TYPE_CHECKING blocks too)."""
  edges = {}
  for name, path in modules.items():
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        # `from tfdp import errors` imports tfdp.errors; `from tfdp.x import f`, tfdp.x.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      else:
        continue
      for target in targets:
        while target and target not in modules:
          target = target.rpartition(".")[0]
        if target and target != name:
          out.add(target)
    edges[name] = out
  return edges


def test_no_module_is_over_500_lines():
  long = {}
  for name, path in _modules().items():
    with open(path, encoding="utf-8") as f:
      lines = len(f.readlines())
    if lines > MAX_LINES:
      long[name] = lines
  assert not long, f"split these by what they own: {long}"


def test_no_import_runs_back_up_to_a_package_above():
  """A module importing the package it sits in (e.g. tfdp.checkpoint.manager importing tfdp)."""
  edges = _imports(_modules())
  back = sorted((m, t) for m, targets in edges.items() for t in targets if m.startswith(t + "."))
  assert not back, back
  # The checker sees imports at all: the manager imports its own package's modules.
  assert "tfdp.checkpoint.persistent.catalog" in edges["tfdp.checkpoint.manager"]


def test_the_save_protocol_fits_on_one_screen():
  from tfdp.checkpoint import manager  # pylint: disable=g-import-not-at-top
  lines = inspect.getsource(manager.CheckpointManager.save).splitlines()
  assert len(lines) <= 60, len(lines)
