"""hbm_guard's modules import one another without a cycle (function-level imports too)."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "hbm_guard" / "_src"


def _imports() -> dict[str, set[str]]:
  out = {}
  for f in SRC.glob("*.py"):
    deps = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ImportFrom) and node.module == "hbm_guard._src":
        deps |= {a.name for a in node.names}
    out[f.stem] = deps
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
