"""The package's shape (README "Layout"): folders by concern, no import cycles,
no module reaching into another's private names, every module saying its job."""
from __future__ import annotations

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "daemon", "elasticd")
ROOT = os.path.dirname(PKG)
# The modules that stay at the top: what every part shares, and ``python -m elasticd``
# (the wiring is node/, above every part); socket_paths is shared with elasticctl, which
# must not pay for the config package's imports at every run.
TOP = {"__init__", "__main__", "errors", "logsetup", "sdnotify", "statedir", "settingfield",
       "values", "fields", "socket_paths"}
GENERATED = ("v1", "etcdpb")


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


def test_no_import_cycles():
    """Counting imports inside functions too, but for the listed lazy ones (LATE_IMPORTS)."""
    graph = {}
    for name in MODULES:
        deps = set()
        for target, names, top in _imports(name):
            if not top and target in LATE_IMPORTS.get(name, set()):
                continue
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


# Private names of other libraries that a module may use: the stdlib's and a
# namedtuple's API, and the torch factory sitecustomize wraps in a worker.
FOREIGN_PRIVATE = {"_exit", "_current_frames", "_replace", "_asdict", "_fields", "_make"}
FOREIGN_PRIVATE_IN = {"elasticd.worker_site.sitecustomize": {"_create_c10d_store"}}


def _defined_private(tree) -> set[str]:
    """The private names a module defines: functions, classes, attributes, variables."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_")}


def test_no_module_reaches_into_another_objects_private_attributes():
    """``store._call`` from a module that does not define ``_call`` reaches into
    another module's object: give that module a public method instead."""
    reached = []
    for name, (path, _) in MODULES.items():
        tree = ast.parse(open(path).read())
        own = _defined_private(tree) | FOREIGN_PRIVATE | FOREIGN_PRIVATE_IN.get(name, set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__") or node.attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            reached.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not reached, reached


# Imports of the package's own modules that stay inside a function, each for a
# reason: the command line loads what a subcommand needs, the store backend
# is the one the settings name, torch loads only in a worker. Any other
# import of our own modules sits at the top of the module, where the cycle
# test sees it.
LATE_IMPORTS = {
    "elasticd.node.cli": {"elasticd.trust", "elasticd.store", "elasticd.store.etcd3",
                          "elasticd.node.daemon"},
    "elasticd.config": {"elasticd.workers.template_key", "elasticd.gpus.inventory"},
    # the same two, where config/ is a package (config/rules.py)
    "elasticd.config.rules": {"elasticd.workers.template_key", "elasticd.gpus.inventory"},
    "elasticd.store": {"elasticd.store.etcd2", "elasticd.store.etcd3"},
    "elasticd.inprocess": {"elasticd.inprocess"},   # the wrapper imports torch
    "elasticd.snapshot": {"elasticd.snapshot"},     # save/restore import torch
}


def test_imports_of_our_own_modules_inside_functions_are_the_listed_lazy_ones():
    late = [f"{name} imports {target} inside a function"
            for name in MODULES for target, _, top in _imports(name)
            if not top and target.startswith("elasticd.")
            and target not in LATE_IMPORTS.get(name, set())]
    assert not late, late


def _package(module: str) -> str:
    """The floor a module lives on: its folder, or itself at the top level."""
    parts = module.split(".")
    if len(parts) == 1:
        return module
    return parts[1] if len(parts) > 2 or MODULES[module][1] else module


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {_package(m): set() for m in MODULES}
    for name in MODULES:
        for target, names, _ in _imports(name):
            for t in [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES] or \
                    ([target] if target in MODULES else []):
                if _package(t) != _package(name):
                    graph[_package(name)].add(_package(t))
    return graph


def floors_and_upward_arrows() -> tuple[list[list[str]], list[str]]:
    """The folders stacked in floors (each imports only from floors below), and the
    imports that run back up. Folders that import each other are ordered by how
    much more they are imported than they import (a greedy cut), and whatever
    then points up is an upward arrow."""
    graph = _package_graph()
    order: list[str] = []
    left = {v: set(ws) for v, ws in graph.items()}
    while left:
        sinks = sorted(v for v, ws in left.items() if not ws & left.keys())
        if not sinks:   # a circle: the folder the others lean on most goes lowest
            sinks = [min(sorted(left), key=lambda v: len(left[v] & left.keys())
                         - sum(v in left[u] for u in left))]
        order.extend(sinks)
        for v in sinks:
            del left[v]
    rank = {v: i for i, v in enumerate(order)}
    up = sorted(f"{v} -> {w}" for v, ws in graph.items() for w in ws if rank[w] > rank[v])
    floor: dict[str, int] = {}
    for v in order:
        floor[v] = 1 + max((floor[w] for w in graph[v] if rank[w] < rank[v]), default=0)
    stacked = [sorted(v for v in floor if floor[v] == f) for f in range(1, max(floor.values()) + 1)]
    return stacked, up


# Issue #31: at most 7 floors; no arrow back up (the issue allowed 3; none is left).
MAX_FLOORS = 7
MAX_UPWARD = 0


def test_floors_and_arrows_back_up():
    stacked, up = floors_and_upward_arrows()
    report = "\n".join(f"floor {i}: {', '.join(f)}" for i, f in enumerate(stacked, 1))
    print(f"\n{report}\nupward: {up}")
    assert len(stacked) <= MAX_FLOORS and len(up) <= MAX_UPWARD, (report, up)
