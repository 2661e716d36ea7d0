"""hbm_guard's modules import one another without a cycle (function-level imports too), each
folder of `_src` only the folders below it, and each module fits in a head."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "hbm_guard" / "_src"


def _imports() -> dict[str, set[str]]:
  """module -> the hbm_guard._src modules it imports, named by their path under _src."""
  out = {}
  for f in SRC.rglob("*.py"):
    deps = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hbm_guard._src"):
        package = node.module[len("hbm_guard._src"):].lstrip(".")
        names = [a.name for a in node.names]
        deps |= ({f"{package}.{n}".lstrip(".") for n in names}
                 if not package or (SRC / package).is_dir() else {package})
    name = ".".join(f.relative_to(SRC).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = deps
  return out


def test_no_import_cycle():
  graph = _imports()
  state: dict[str, int] = {}  # 1: on the path, 2: done
  cycles = []

  def visit(node, path):
    state[node] = 1
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == 1:
        cycles.append(path[path.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, cycles



# _src's folders, lowest first: each may import only itself and the folders before it.
GROUPS = ("record", "memory", "plans", "files", "search", "dropin", "backends", "guard", "cli")


def test_every_module_lives_in_a_group():
  loose = sorted(f.name for f in SRC.glob("*.py") if f.name != "__init__.py")
  folders = sorted(d.name for d in SRC.iterdir() if d.is_dir() and d.name != "__pycache__")
  assert not loose, loose
  assert folders == sorted(GROUPS), folders


def test_each_group_imports_only_the_groups_below_it():
  rank = {g: i for i, g in enumerate(GROUPS)}
  upward = sorted(
      (module, dep) for module, deps in _imports().items() for dep in deps
      if rank[dep.split(".")[0]] > rank[module.split(".")[0]])
  assert not upward, upward


def test_each_group_says_what_it_may_import():
  for i, group in enumerate(GROUPS):
    doc = ast.get_docstring(ast.parse((SRC / group / "__init__.py").read_text(encoding="utf-8")))
    said = doc.rsplit("May import:", 1)[1].strip().rstrip(".")
    expected = ("nothing of hbm_guard" if i == 0 else
                "every other group" if i == len(GROUPS) - 1 else ", ".join(GROUPS[:i]))
    assert said == expected, (group, said)


ROOT = SRC.parent.parent
MAX_MODULE_LINES = 450
# Underscore names that are public API of other libraries: NamedTuple's methods, CPython's
# frame access.
_FOREIGN_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_getframe"})


def _modules():
  for folder in ("hbm_guard", "integrations"):
    yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_module_fits_in_a_head():
  long = {str(f.relative_to(ROOT)): n for f in _modules()
          if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
  assert not long, long


def _defined_private(tree: ast.AST) -> set[str]:
  """Underscore names a module defines: functions, classes, attributes it assigns."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
      names.add(node.attr)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
  return {n for n in names if n.startswith("_")}


def test_no_private_name_is_read_across_modules():
  found = []
  for f in _modules():
    tree = ast.parse(f.read_text(encoding="utf-8"))
    own = _defined_private(tree)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and node.attr not in _FOREIGN_API
          and node.attr not in own
          and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
        found.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hbm_guard"):
        found += [f"{f.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                  if a.name.startswith("_") and a.name != "_src"]
  assert not found, found


def _assigns_state(fn: ast.FunctionDef) -> bool:
  for node in ast.walk(fn):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    if any(isinstance(t, ast.Attribute) for t in targets):
      return True
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__setattr__"):
      return True
  return False


def test_no_property_assigns_state():
  found = []
  for f in _modules():
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
      if (isinstance(node, ast.FunctionDef)
          and any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
          and _assigns_state(node)):
        found.append(f"{f.relative_to(ROOT)}:{node.lineno}: {node.name}")
  assert not found, found


def test_what_a_kind_of_rung_does_is_decided_by_its_spec_alone():
  """#58 item 2: no module outside the rung specs branches on a rung's kind; each kind has
  one spec holding its field, applicability, application, saving, search axis and trust."""
  from hbm_guard._src.plans import rung_specs
  from hbm_guard._src.plans import rungs
  assert set(rung_specs.SPECS) == set(rungs.RungKind)
  homes = {SRC / "plans" / "rungs.py", SRC / "plans" / "rung_specs.py"}
  branching = [f"{f.relative_to(ROOT)}:{i}" for f in SRC.rglob("*.py") if f not in homes
               for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
               if "RungKind." in line or ".kind is Kind." in line or "kind in (Kind" in line]
  assert not branching, branching


def test_the_design_page_names_every_module_in_its_folder():
  page = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
  sections = {s.split("`", 2)[1].rstrip("/"): s for s in page.split("\n## ")[1:]}
  missing = sorted(f"{group}/{f.name}" for group in GROUPS for f in (SRC / group).glob("*.py")
                   if f.name != "__init__.py" and f"`{f.name}`" not in sections.get(group, ""))
  assert not missing, missing
