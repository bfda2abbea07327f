"""The package's shape (README "Layout"): folders by concern, no import cycles,
no module reaching into another's private names, every module saying its job."""
from __future__ import annotations

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "daemon", "elasticd")
ROOT = os.path.dirname(PKG)
# The modules that stay at the top: the wiring and what every part shares.
TOP = {"__init__", "__main__", "cli", "daemon", "errors", "logsetup", "sdnotify",
       "statedir", "settingfield"}
GENERATED = ("v1",)


def _modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (path, is a package), generated stubs left out."""
    found = {}
    for d, dirs, files in os.walk(PKG):
        dirs[:] = [x for x in dirs if x not in GENERATED and x != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                is_pkg = name.endswith(".__init__")
                found[name[:-9] if is_pkg else name] = (path, is_pkg)
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, list[str], bool]]:
    """(target module, names imported from it, at module level) for each import."""
    path, is_pkg = MODULES[name]
    tree = ast.parse(open(path).read())
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    top = set(map(id, tree.body))
    for node in tree.body:
        if isinstance(node, ast.If):  # TYPE_CHECKING and the like: still module level
            top.update(map(id, node.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - (node.level - 1)]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], id(node) in top) for a in node.names)
    return out


def test_the_top_level_holds_only_the_wiring_and_what_every_part_shares():
    top = {os.path.basename(p)[:-3] for n, (p, pkg) in MODULES.items()
           if not pkg and n.count(".") == 1}
    assert top <= TOP, f"put these in the folder of their part: {sorted(top - TOP)}"


def test_every_module_says_its_job_on_its_first_line():
    silent = [n for n, (p, _) in MODULES.items()
              if not (ast.get_docstring(ast.parse(open(p).read())) or "").strip()]
    assert not silent, silent


def test_no_import_cycles_at_module_level():
    graph = {}
    for name in MODULES:
        deps = set()
        for target, names, top in _imports(name):
            if not top:
                continue  # a late import inside a function is a deliberate break
            for n in names:
                if f"{target}.{n}" in MODULES:
                    deps.add(f"{target}.{n}")
            if target in MODULES and not any(f"{target}.{n}" in MODULES for n in names):
                deps.add(target)
        graph[name] = deps - {name}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycle = stack[stack.index(w):] + [w]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if w not in state:
                visit(w)
        stack.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v)


def test_no_module_imports_another_modules_private_names():
    reached = []
    for name in MODULES:
        for target, names, _ in _imports(name):
            if not target.startswith("elasticd") or target == name:
                continue
            own_package = MODULES.get(target, ("", False))[1] and name.startswith(target + ".")
            for n in names:
                sub = f"{target}.{n}"
                if n.startswith("_") and sub not in MODULES and not own_package:
                    reached.append(f"{name} imports {target}.{n}")
    assert not reached, reached
