"""No import cycle between the modules of quantspec/, function-local imports included.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a module (module level or inside a function) is an edge, relative imports resolved;
imports under ``if TYPE_CHECKING:`` are not (they never run). ``from pkg import name`` points at
the submodule ``pkg.name`` when there is one, else at ``pkg``. Importing ``a.b.c`` also runs the
``__init__`` of every package on the way (``a.b``) that the importer does not already sit in, so
those are edges too: ``runtime.decoder`` importing ``specdec.x`` would run ``specdec/__init__``.
Cycles are the strongly connected components of that graph (Tarjan), each shown as one path.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quantspec"


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = f.relative_to(package.parent).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imported(module: str, is_pkg: bool, node: ast.AST, known: set[str]) -> list[str]:
    """Names of the package's modules that ``node`` (an import statement) loads directly."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_pkg else module.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join([*here, *([base] if base else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return []
    found = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of ``package`` whose import it triggers (see the module docstring)."""
    mods = _modules(package)
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_only(tree)
        own_packages = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1 + is_pkg)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for target in _imported(m, is_pkg, node, known):
                parts = target.split(".")
                chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
                graph[m] |= {t for t in chain - own_packages if t in known and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def path_through(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself (breadth first)."""
    start, comp = comp[0], set(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def test_quantspec_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    found = [f"{' -> '.join(path_through(graph, c))}  (component: {', '.join(c)})" for c in cycles(graph)]
    assert not found, "import cycles in quantspec/:\n" + "\n".join(found)


def _fake_graph(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """Write ``files`` (relative path -> source) under ``root`` and read the graph of ``root/pkg``."""
    for rel, text in {"pkg/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return import_graph(root / "pkg")


def test_finder_sees_a_cycle_through_a_function_local_import(tmp_path):
    graph = _fake_graph(tmp_path, {
        "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from .a import f\n    return f\n",
    })
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert path_through(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]


def test_finder_resolves_relative_levels_and_package_inits(tmp_path):
    # importing pkg.low.kv runs pkg/low/__init__.py first: top.dec -> low -> kv, no cycle
    # while low/__init__ does not import loop; one once it does (loop -> top.dec)
    assert cycles(_fake_graph(tmp_path, {
        "pkg/low/__init__.py": "from .kv import Cache\n",
        "pkg/low/kv.py": "class Cache: ...\n",
        "pkg/low/loop.py": "from ..top.dec import run\n",
        "pkg/top/__init__.py": "",
        "pkg/top/dec.py": "def run():\n    import pkg.low.kv\n",
    })) == []
    graph = _fake_graph(tmp_path, {"pkg/low/__init__.py": "from .kv import Cache\nfrom .loop import run\n"})
    assert cycles(graph) == [["pkg.low", "pkg.low.loop", "pkg.top.dec"]]
    assert path_through(graph, cycles(graph)[0]) == ["pkg.low", "pkg.low.loop", "pkg.top.dec", "pkg.low"]


def test_finder_skips_type_checking_and_same_package_inits(tmp_path):
    graph = _fake_graph(tmp_path, {
        "pkg/__init__.py": "from .a import A\nfrom .b import B\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nclass A: ...\n",
        "pkg/b.py": "from . import a\nclass B(a.A): ...\n",
    })
    assert graph["pkg.b"] == {"pkg.a"}  # `from . import a` is the submodule, not pkg/__init__
    assert graph["pkg.a"] == set()
    assert cycles(graph) == []
