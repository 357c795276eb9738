"""The package's import graph (``tests/import_graph.py``, built from the sources with ``ast``):
its cycles are exactly the known ones, and its function-level imports of its own modules do not
grow.

The goal is no import cycle at all: ``KNOWN_CYCLES`` empty, every module importable on its own
with its dependencies below it, and an import inside a function only where it defers a heavy or
optional dependency (torch, cutlass, vLLM, transformers), never to get around a cycle, with a
comment on its line or the line above that says why. Until then
this test holds the line both ways: a new cycle (or a cycle that grows) fails it, and so does a
cycle that was broken or shrank, so that ``KNOWN_CYCLES`` is shrunk with it and cannot grow back
unnoticed. ``python tests/import_graph.py`` prints the cycles with the edges inside each (what to
cut) and the function-level imports.
"""

from __future__ import annotations

import functools
import re
import textwrap
import tokenize
from pathlib import Path

import import_graph as G

# Each cycle: the modules of one strongly connected component of the import graph (module-level
# and function-level imports together), short names sorted ("directkv_cute" is the package's
# __init__, which imports ops when torch is loaded). Shrink this list as cycles are broken; the
# goal is [].
KNOWN_CYCLES = []

# Import statements inside functions that name one of the package's own modules (one per
# statement and module named). Lower it as they move to the top of their modules; never raise it.
MAX_FUNCTION_LEVEL_IMPORTS = 29


@functools.lru_cache(maxsize=1)
def _package_edges() -> tuple:
    """The package's import edges, read once per test run."""
    return tuple(G.edges())


def _explain(found, cycles) -> str:
    lines = []
    for comp in cycles:
        lines.append(f"cycle {list(comp)}:")
        lines += [f"    {e}" for e in G.cycle_edges(found, comp)]
    return "\n".join(lines)


def test_the_import_cycles_are_exactly_the_known_ones():
    found = _package_edges()
    got = G.cycles(found)
    known = sorted(tuple(sorted(c, key=lambda m: (m != "directkv_cute", m))) for c in KNOWN_CYCLES)
    got_sets, known_sets = {frozenset(c) for c in got}, {frozenset(c) for c in known}
    new = [c for c in got if frozenset(c) not in known_sets]
    gone = [c for c in known if frozenset(c) not in got_sets]
    message = []
    if new:
        message.append("import cycles not in KNOWN_CYCLES (a new cycle, or a known one that changed):\n"
                       + _explain(found, new))
    if gone:
        message.append("KNOWN_CYCLES lists cycles that are no longer there: good, shrink KNOWN_CYCLES to the "
                       f"cycles found now ({[list(c) for c in got]}); no longer found: {[list(c) for c in gone]}")
    assert not message, "\n\n".join(message)


def test_no_cycle_runs_at_import_time():
    """Module-level imports alone form no cycle (a module half-initialised when another reads it)."""
    found = _package_edges()
    got = G.cycles(found, function_level=False)
    assert got == [], _explain([e for e in found if not e.function_level], got)


def test_function_level_imports_of_the_package_do_not_grow():
    inside = G.function_level_imports(_package_edges())
    listing = "\n".join(f"    {e}" for e in inside)
    assert len(inside) <= MAX_FUNCTION_LEVEL_IMPORTS, (
        f"{len(inside)} function-level imports of the package's own modules, over the recorded "
        f"{MAX_FUNCTION_LEVEL_IMPORTS}: import at the top of the module instead (a cycle that forces it is a "
        f"cycle to break):\n{listing}")
    if len(inside) < MAX_FUNCTION_LEVEL_IMPORTS:
        print(f"{len(inside)} function-level imports, fewer than the recorded {MAX_FUNCTION_LEVEL_IMPORTS}: "
              "lower MAX_FUNCTION_LEVEL_IMPORTS to it")


# A comment that is only a linter's or a type checker's marker says nothing about why.
_MARKER = re.compile(r"(noqa|type:\s*ignore|pragma)\b", re.I)


def _why(path: Path, line: int) -> str | None:
    """The comment that says why the import statement starting at ``line`` of ``path`` sits inside
    a function: one on that line, else a whole-line comment on the line just above it (a trailing
    comment of the statement above does not count); None where there is neither."""
    with tokenize.open(path) as f:
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(f.readline) if tok.type == tokenize.COMMENT}
    lines = path.read_text().splitlines()
    candidates = [comments.get(line, "")]
    if line > 1 and lines[line - 2].lstrip().startswith("#"):
        candidates.append(comments.get(line - 1, ""))
    return next((text for text in candidates if text and not _MARKER.match(text)), None)


def test_every_function_level_import_says_why():
    """Each remaining import of the package's own modules inside a function names the heavy or
    optional dependency it defers (a comment on its line or the line above)."""
    silent = [e for e in G.function_level_imports(_package_edges()) if _why(G.ROOT / e.path, e.line) is None]
    listing = "\n".join(f"    {e}" for e in silent)
    assert not silent, (
        f"{len(silent)} function-level imports of the package's own modules without a comment saying why (on the "
        "import's line or the line above: the optional or heavy dependency it defers, e.g. '# loads torch: the CLI "
        f"imports without it'); move them to the top of their modules where nothing demands it:\n{listing}")


def test_the_why_is_a_comment_on_the_line_or_the_line_above(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent("""\
        def f():
            x = 1  # a trailing comment of another statement
            import a
            import b  # noqa: F401
            # loads torch
            import c
            import d  # noqa: F401 - loads torch
            import e  # transformers is optional
            s = "# in a string"
            import g
        """))
    assert [_why(path, n) for n in (3, 4, 6, 7, 8, 10)] == [
        None, None, "loads torch", None, "transformers is optional", None]


def test_the_graph_covers_the_package():
    """The builder sees every module of the package, the folders pyproject maps into it included."""
    mods = G.modules()
    assert "directkv_cute" in mods and "directkv_cute.planner" in mods
    assert "directkv_cute.tuning.lookup" in mods and "directkv_cute.profiles" in mods
    assert len(mods) >= 60
    found = _package_edges()
    assert len(found) >= 200 and {e.source for e in found} <= set(mods) and {e.target for e in found} <= set(mods)


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_builder_resolves_each_kind_of_import(tmp_path):
    _write(tmp_path, {
        "pyproject.toml": """
            [tool.setuptools]
            package-dir = {"directkv_cute" = "directkv_cute", "directkv_cute.sub" = "directkv_cute/sub", "directkv_cute.tuning" = "tuning"}
            """,
        "directkv_cute/__init__.py": """
            from importlib import import_module
            import_module("directkv_cute.c")
            CONSTANT = 1
            """,
        "directkv_cute/a.py": """
            import os
            from directkv_cute import b, CONSTANT
            from . import c as cc
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from directkv_cute.sub import deep
            class K:
                from directkv_cute.sub.deep import x
            def f():
                import directkv_cute.sub.deep.attr_is_not_a_module
                return lambda: __import__("os")
            thing = 1
            """,
        "directkv_cute/b.py": """
            def g():
                from .a import thing
                from ..outside import nothing
            """,
        "directkv_cute/c.py": "",
        "directkv_cute/sub/__init__.py": "from .deep import x\n",
        "directkv_cute/sub/deep.py": """
            from .. import c
            from directkv_cute.tuning import lookup
            x = 1
            """,
        "tuning/__init__.py": "",
        "tuning/lookup.py": "from . import other\nfrom .other import y\n",
        "tuning/other.py": "def h():\n    from directkv_cute.sub import deep\n",
    })
    assert set(G.modules(tmp_path)) == {
        "directkv_cute", "directkv_cute.a", "directkv_cute.b", "directkv_cute.c", "directkv_cute.sub",
        "directkv_cute.sub.deep", "directkv_cute.tuning", "directkv_cute.tuning.lookup", "directkv_cute.tuning.other"}
    got = {(G.short(e.source), G.short(e.target), e.function_level) for e in G.edges(tmp_path)}
    assert got == {
        ("directkv_cute", "c", False),
        ("a", "b", False), ("a", "directkv_cute", False), ("a", "c", False), ("a", "sub.deep", False),
        ("a", "sub.deep", True),
        ("b", "a", True),
        ("sub", "sub.deep", False),
        ("sub.deep", "c", False), ("sub.deep", "tuning.lookup", False),
        ("tuning.lookup", "tuning.other", False),
        ("tuning.other", "sub.deep", True),
    }
    assert G.cycles(G.edges(tmp_path)) == [("a", "b"), ("sub.deep", "tuning.lookup", "tuning.other")]
    assert G.cycles(G.edges(tmp_path), function_level=False) == []
    assert len(G.function_level_imports(G.edges(tmp_path))) == 3
