"""The shape of the package, read from its source with `ast` (no TensorFlow): rooms, arrows, sizes, the map.

The rules, as the checks below read them:
- The graph: every `import`/`from ... import` of a tfdp module anywhere in a
  module (function bodies and TYPE_CHECKING blocks too), resolved to the most
  specific module that exists (`from tfdp.data import iterators` is
  tfdp.data.iterators; `from tfdp.data import Source` is tfdp.data).
- A module's room is the nearest package that holds it (tfdp.checkpoint.local
  for checkpoint/local/tier.py, tfdp.checkpoint for checkpoint/manager.py).
  Every room but tfdp itself says in its `__init__` docstring what it owns
  ("Owns:") and which packages it may import ("May import:", a comma-separated
  list of dotted package or module names, possibly over several lines, up to
  the first blank line).
- A module may import: any module of its own room or of a package below it
  (a package is above its sub-packages: tfdp.checkpoint's manager may use
  tfdp.checkpoint.local); any module of, or below, a package its room's
  "May import:" names (naming tfdp.checkpoint allows tfdp.checkpoint.format
  too); and the floor, tfdp.errors and tfdp._version, which import no tfdp
  module themselves. A sub-package's rules are its own: it does not inherit
  its parent's "May import:" (tfdp.checkpoint.local names what it uses).
- The modules at the top of tfdp (the lazy public face and its alias
  modules) may import any room: they are the roof, and nothing below them
  imports them.
- The "May import:" lines themselves form no cycle.
- docs/internals.md names each module by its path below tfdp/
  (`checkpoint/format/layout.py`, optionally with the `tfdp/` prefix); a
  package's `__init__.py` is named by its folder (`checkpoint/format/`).
"""

import ast
import functools
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGE = os.path.join(REPO, "tfdp")
MAX_LINES = 400
MAX_TOP_MODULES = 8
FLOOR = ("tfdp.errors", "tfdp._version")
# A fault-injection hook: the tests' own modules, and the hook module that
# used to sit in the write path.
HOOKS = ("tfdp.checkpoint.faults", "tests")


@functools.cache
def _modules():
  """{dotted name: path} of every module of tfdp."""
  found = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        found[name.removesuffix(".__init__")] = path
  return dict(sorted(found.items()))


def _is_package(path):
  return path.endswith("__init__.py")


def _raw_imports(name, path):
  """[(dotted names one import statement names, lineno)] for every import anywhere in the module at `path`.

  `from P import x` gives [P.x, P] (x may be a module or a name in P);
  relative imports are made absolute.
  """
  package = name if _is_package(path) else name.rsplit(".", 1)[0]
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.extend(([a.name], node.lineno) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      found.extend(([f"{base}.{a.name}", base], node.lineno) for a in node.names)
  return found


def _resolve(target, modules):
  """The most specific module of tfdp that `target` names or sits in ('' if none)."""
  while target and target not in modules:
    target = target.rpartition(".")[0]
  return target


@functools.cache
def _graph():
  """{module: the tfdp modules it imports}, parsed once for all checks.

  `from tfdp.data import iterators` is an arrow to tfdp.data.iterators;
  `from tfdp.data import Source`, to tfdp.data.
  """
  modules = _modules()
  edges = {}
  for name, path in modules.items():
    out = set()
    for names, _ in _raw_imports(name, path):
      resolved = _resolve(names[0], modules)
      if resolved and resolved != name:
        out.add(resolved)
    edges[name] = out
  return edges


def _room(name, modules):
  """The nearest package holding module `name` (a package's room is itself)."""
  if _is_package(modules[name]):
    return name
  return name.rpartition(".")[0]


def _docstring(package, modules):
  with open(modules[package], encoding="utf-8") as f:
    return ast.get_docstring(ast.parse(f.read())) or ""


def _field(doc, label):
  """The text after `label` up to the first blank line, on one line; None if absent."""
  match = re.search(rf"^{label}\s*(.*?)(?:\n\s*\n|\Z)", doc, re.M | re.S)
  return " ".join(match.group(1).split()) if match else None


def _may_import(package, modules):
  """The dotted names a package's `__init__` lists after "May import:" (None: no such line)."""
  text = _field(_docstring(package, modules), "May import:")
  if text is None:
    return None
  return [n.strip().rstrip(".") for n in re.split(r",|\band\b", text) if n.strip().rstrip(".")]


def _rooms(modules):
  return sorted(n for n, p in modules.items() if _is_package(p) and n != "tfdp")


def _under(name, package):
  return name == package or name.startswith(package + ".")


def _find_cycle(edges):
  """One cycle of `edges` as a path [a, b, ..., a], or None (iterative DFS, deterministic)."""
  colour = {}
  for start in sorted(edges):
    if start in colour:
      continue
    stack = [(start, iter(sorted(edges[start])))]
    path = [start]
    colour[start] = "grey"
    while stack:
      node, children = stack[-1]
      child = next(children, None)
      if child is None:
        colour[node] = "black"
        stack.pop()
        path.pop()
        continue
      if colour.get(child) == "grey":
        return path[path.index(child):] + [child]
      if child not in colour:
        colour[child] = "grey"
        path.append(child)
        stack.append((child, iter(sorted(edges.get(child, ())))))
  return None


def test_the_checker_sees_imports():
  """Guards every check below against a parser that finds nothing."""
  modules = _modules()
  edges = _graph()
  assert "tfdp.checkpoint.persistent.catalog" in edges["tfdp.checkpoint.manager"]
  # function-level imports count: the lazy face imports its rooms inside __getattr__.
  assert any(_under(t, "tfdp.distribute") for t in edges["tfdp"])
  assert "tfdp.errors" in _may_import("tfdp.data", modules)
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  """No cycle among tfdp's modules, counting imports inside functions too (a deferred import is still an arrow)."""
  cycle = _find_cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_allowed_arrows_form_no_cycle():
  """The "May import:" lines, read as a package graph, run one way only.

  A package is above its sub-packages (its modules may import theirs), so a
  sub-package naming its parent, or a module of it, is a cycle too.
  """
  modules = _modules()
  rooms = _rooms(modules)
  edges = {room: {r for r in rooms if r.startswith(room + ".")} for room in rooms}
  for room in rooms:
    for allowed in _may_import(room, modules) or []:
      if allowed in modules and allowed not in FLOOR and _room(allowed, modules) != room:
        edges[room].add(_room(allowed, modules))
  cycle = _find_cycle(edges)
  assert cycle is None, "the May import: lines allow a cycle: " + " -> ".join(cycle)


def test_every_room_says_what_it_owns_and_may_import():
  modules = _modules()
  missing = []
  for room in _rooms(modules):
    doc = _docstring(room, modules)
    if _field(doc, "Owns:") is None:
      missing.append(f"{room}: no 'Owns:'")
    allowed = _may_import(room, modules)
    if allowed is None:
      missing.append(f"{room}: no 'May import:'")
      continue
    unknown = [a for a in allowed if a not in modules]
    if unknown:
      missing.append(f"{room}: 'May import:' names no module {unknown}")
  assert not missing, "\n".join(missing)


def test_no_arrow_back_up():
  """Each module imports only its room (and below), what its room's "May import:" lists, and the floor."""
  modules = _modules()
  edges = _graph()
  for floor in FLOOR:
    assert not edges[floor], f"{floor} is the floor and imports no tfdp module: {edges[floor]}"
  bad = []
  for name, targets in sorted(edges.items()):
    room = _room(name, modules)
    if room == "tfdp":
      continue  # the roof: the lazy public face and its alias modules
    allowed = _may_import(room, modules) or []
    for target in sorted(targets):
      if (target in FLOOR or _under(target, room)
          or any(_under(target, a) for a in allowed)):
        continue
      bad.append(f"{name} -> {target}")
  assert not bad, "arrows not allowed by the room's 'May import:':\n" + "\n".join(bad)


def test_few_modules_at_the_top():
  top = [f for f in os.listdir(PACKAGE) if f.endswith(".py")]
  assert len(top) <= MAX_TOP_MODULES, sorted(top)


def test_no_module_is_over_400_lines():
  long = {}
  for name, path in _modules().items():
    with open(path, encoding="utf-8") as f:
      lines = len(f.readlines())
    if lines > MAX_LINES:
      long[name] = lines
  assert not long, f"split these by what they own: {long}"


def test_no_production_module_imports_a_fault_hook():
  """Fault injection wraps the real writer, fs seam or transport from the tests; production code holds no hook.

  Production code is tfdp and models/ (scripts/ are benchmarks: they may
  reuse a test's worker).
  """
  production = dict(_modules())
  for folder, _, files in os.walk(os.path.join(REPO, "models")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        production[os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")] = path
  bad = []
  for name, path in sorted(production.items()):
    for names, lineno in _raw_imports(name, path):
      if any(_under(names[0], h) for h in HOOKS) and not _under(name, "tfdp.checkpoint.faults"):
        bad.append(f"{name}:{lineno} imports {names[0]}")
  assert not bad, "\n".join(bad)


def _internals_name(name, path):
  rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
  if rel == "__init__.py":
    return rel
  return rel[:-len("__init__.py")] if _is_package(path) else rel


def test_every_module_is_named_in_internals():
  with open(os.path.join(REPO, "docs", "internals.md"), encoding="utf-8") as f:
    text = f.read()
  missing = []
  for name, path in sorted(_modules().items()):
    rel = _internals_name(name, path)
    if not re.search(rf"(?<![\w./-])(?:tfdp/)?{re.escape(rel)}(?![\w/])", text):
      missing.append(rel)
  assert not missing, "docs/internals.md names no line for: " + ", ".join(missing)


def test_the_save_protocol_fits_on_one_screen():
  path = os.path.join(PACKAGE, "checkpoint", "manager.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager")
  save = next(n for n in manager.body if isinstance(n, ast.FunctionDef) and n.name == "save")
  lines = save.end_lineno - (save.decorator_list[0].lineno if save.decorator_list else save.lineno) + 1
  assert lines <= 60, lines
