"""The import graph of the ``directkv_cute`` package, built statically from its sources with ``ast``.

The package's modules are the ``.py`` files of the folders ``pyproject.toml`` maps into it
(``[tool.setuptools] package-dir``: ``directkv_cute/`` itself, ``tuning/`` as
``directkv_cute.tuning``, ``profiles/`` as ``directkv_cute.profiles``), named as they import.

An edge ``a -> b`` is an ``import`` / ``from ... import`` statement in module ``a`` that names
module ``b`` of the package:

* ``import directkv_cute.x.y`` names ``directkv_cute.x.y``;
* ``from directkv_cute.x import name`` names ``directkv_cute.x.name`` where that is a module
  (a submodule imported by name), else ``directkv_cute.x`` (a name defined in it, or in its
  ``__init__``);
* relative imports (``from . import x``, ``from ..y import z``) resolve against the importing
  module's package first.

Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; those implicit edges are not
drawn (every module would then sit in a cycle with its package's ``__init__``): an edge to a
package's ``__init__`` is drawn only where a statement names the package itself. Imports under
``if TYPE_CHECKING:`` never run and are left out. ``importlib.import_module("directkv_cute.x")``
with a literal absolute name is an import of ``directkv_cute.x`` (the package's ``__init__`` loads
``ops`` so when torch is loaded); one of a computed name (the lazy attributes of the package's
``__getattr__``) is not seen.

Each edge is *module-level* (runs when ``a`` is imported: at the top, in a class body, under a
module-level ``if`` / ``try``) or *function-level* (inside a ``def`` or ``lambda``: runs when the
function is called, the usual way around a cycle).

Run ``python tests/import_graph.py`` for the cycles and the function-level imports of today.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "directkv_cute"


@dataclass(frozen=True)
class Edge:
    """One import statement of ``source`` naming module ``target`` of the package."""

    source: str
    target: str
    line: int
    function_level: bool
    path: str  # the importing file, relative to the repository root

    def __str__(self) -> str:
        where = "function-level" if self.function_level else "module-level"
        return f"{self.path}:{self.line}: {short(self.source)} -> {short(self.target)} ({where})"


def short(module: str) -> str:
    """A module's name without the package prefix ("planner", "tuning.lookup"; the package's own
    ``__init__``: "directkv_cute")."""
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else module


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """{package name: folder} of the package and its subpackages, from pyproject.toml's
    ``package-dir`` (a subpackage that is not mapped lives in its parent's folder)."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # 3.10: the one line that pyproject.toml keeps it on
        line = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, re.M).group(1)
        mapping = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', line))
    else:
        mapping = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items() if name == PACKAGE or
            name.startswith(PACKAGE + ".")}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """{module name: file} of every module of the package (a package's ``__init__.py`` under the
    package's name)."""
    out: dict[str, Path] = {}
    dirs = package_dirs(root)
    folders = {folder.resolve() for folder in dirs.values()}
    for pkg, folder in sorted(dirs.items()):
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            # a file under a folder mapped on its own is named by that mapping's walk
            owner = max((f for f in folders if path.resolve().is_relative_to(f)), key=lambda f: len(f.parts))
            if owner != folder.resolve():
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_module_name(node: ast.AST) -> str | None:
    """The module an ``import_module("name")`` / ``importlib.import_module("name")`` call with an
    absolute literal name imports, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    arg = node.args[0]
    if called != "import_module" or not isinstance(arg, ast.Constant) or not isinstance(arg.value, str):
        return None
    return None if arg.value.startswith(".") else arg.value


def _imports(tree: ast.AST):
    """(node, function_level) of every import statement that may run, in source order."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the else branch runs
                    visit_stmt(sub, in_function)
                continue
            visit_stmt(child, in_function)

    def visit_stmt(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append((child, in_function))
            return
        name = _import_module_name(child)
        if name is not None:
            out.append((ast.Import(names=[ast.alias(name=name)], lineno=child.lineno, col_offset=child.col_offset),
                        in_function))
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        visit(child, inner)

    visit(tree, False)
    return sorted(out, key=lambda t: (t[0].lineno, t[0].col_offset))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(node: ast.AST, module: str, path: Path, known) -> list[str]:
    """The package's modules an import statement names."""
    targets = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:  # a name under a module: the module
                name = name.rpartition(".")[0]
            if name:
                targets.append(name)
        return targets
    if node.level:
        base = _package_of(module, path)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            targets.append(sub)
        elif base in known:
            targets.append(base)
    return targets


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import edge between the package's modules: one per statement and module it names
    (self-imports left out), in module and line order."""
    mods = modules(root)
    known = set(mods)
    out = []
    for module, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_function in _imports(tree):
            for target in dict.fromkeys(_resolve(node, module, path, known)):  # once per statement
                if target != module:
                    out.append(Edge(module, target, node.lineno, in_function, path.relative_to(root).as_posix()))
    return out


def graph(edge_list, function_level: bool = True) -> dict[str, set[str]]:
    """{module: modules it imports} (with ``function_level`` False: module-level edges only)."""
    g: dict[str, set[str]] = {}
    for e in edge_list:
        if function_level or not e.function_level:
            g.setdefault(e.source, set()).add(e.target)
            g.setdefault(e.target, set())
    return g


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``g`` (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                out.append(sorted(comp))
    return out


def cycles(edge_list, function_level: bool = True) -> list[tuple[str, ...]]:
    """The import cycles: every strongly connected component of more than one module, as sorted
    tuples of short module names, sorted."""
    g = graph(edge_list, function_level)
    return sorted(tuple(short(m) for m in comp) for comp in strongly_connected(g) if len(comp) > 1)


def cycle_edges(edge_list, component) -> list[Edge]:
    """The edges inside one cycle (its modules given by short name): what to cut."""
    members = {m if m == PACKAGE else f"{PACKAGE}.{m}" for m in component}
    return [e for e in edge_list if e.source in members and e.target in members]


def function_level_imports(edge_list) -> list[Edge]:
    """The function-level import edges between the package's own modules."""
    return [e for e in edge_list if e.function_level]


def main() -> int:
    found = edges()
    print(f"{len(modules())} modules, {len(found)} import edges, "
          f"{len(function_level_imports(found))} of them function-level")
    for comp in cycles(found):
        print(f"\ncycle {list(comp)}:")
        for e in cycle_edges(found, comp):
            print(f"  {e}")
    print(f"\nmodule-level cycles: {cycles(found, function_level=False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
