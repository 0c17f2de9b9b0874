"""The package's layout (issue 37): no module over 800 lines (a module that
grows past it is split by concern, as communicator.py and bootstrap.py
were), and no import circle among the modules' top-level imports, those
under ``if TYPE_CHECKING:`` included (imports inside functions, made at run
time, are not counted)."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "streamcoll")
MAX_LINES = 800


def _modules() -> Dict[str, str]:
    """Dotted module name -> file, for every .py and .pyi of the package
    (a stub stands in for its module: it is what type checkers read)."""
    out: Dict[str, str] = {}
    for d, dirs, files in os.walk(PKG):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith((".py", ".pyi")):
                continue
            rel = os.path.relpath(os.path.join(d, f), ROOT)
            name = rel.rsplit(".", 1)[0].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            if f.endswith(".pyi") or name not in out:
                out[name] = os.path.join(d, f)
    return out


def test_no_module_is_over_800_lines():
    long = {}
    for d, dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_LINES:
                    long[os.path.relpath(p, ROOT)] = n
    assert long == {}, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def _top_level_imports(tree: ast.Module) -> List[ast.stmt]:
    """The module body's imports and those inside its top-level ``if``/``try``
    blocks (``if TYPE_CHECKING:``), not those in functions or classes."""
    out: List[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out.append(n)
        elif isinstance(n, ast.If):
            todo += n.body + n.orelse
        elif isinstance(n, ast.Try):
            todo += n.body + n.orelse + n.finalbody + [s for h in n.handlers for s in h.body]
    return out


def _graph(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    g: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if os.path.basename(path).startswith("__init__.") else m.rsplit(".", 1)[0]
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for n in _top_level_imports(tree):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                assert isinstance(n, ast.ImportFrom)
                if n.level:
                    parts = package.split(".")[: len(package.split(".")) - n.level + 1]
                    base = ".".join(parts + ([n.module] if n.module else []))
                else:
                    base = n.module or ""
                subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in mods]
                # ``from . import x`` imports the submodule x; ``from .x import y`` the module x
                targets = subs + ([base] if len(subs) < len(n.names) else [])
            g[m].update(t for t in targets if t in mods and t != m)
    return g


def _circles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_top_level_imports():
    """A circle here is one a type checker follows too (``TYPE_CHECKING``
    imports count): the bases of Communicator and env's protocols exist so
    that there is none."""
    g = _graph(_modules())
    assert g["streamcoll.communicator"] >= {"streamcoll.p2p", "streamcoll.fast_paths"}  # the graph is read
    assert _circles(g) == []
