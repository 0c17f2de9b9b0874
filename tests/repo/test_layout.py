"""The package's layout (issues 37 and 44): no module over 800 lines (a
module that grows past it is split by concern, as communicator.py and
bootstrap.py were); no import circle, counting every import a module makes:
top-level ones, those under ``if TYPE_CHECKING:`` and those inside
functions (an import deferred to run time still ties the two modules: it only
hides the circle from the first import); and imports one way through the
layers of :data:`LAYERS`, so that the core never imports the diagnostics
that observe it (they attach through :mod:`streamcoll.core.hooks`)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

import pytest

from conftest import ROOT

PKG = os.path.join(ROOT, "streamcoll")
MAX_LINES = 800


def _modules(root: str = ROOT) -> Dict[str, str]:
    """Dotted module name -> file, for every .py and .pyi of the package
    under ``root``: the module's .py, its stub where it has no .py. A stub
    beside its module is read with it (:func:`_sources`): what type checkers
    read and what runs are both the module's imports."""
    out: Dict[str, str] = {}
    for d, dirs, files in os.walk(os.path.join(root, "streamcoll")):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith((".py", ".pyi")):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)
            name = rel.rsplit(".", 1)[0].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            if f.endswith(".py") or name not in out:
                out[name] = os.path.join(d, f)
    return out


def _sources(path: str) -> List[str]:
    """``path`` and, for a .py with a stub beside it, the stub."""
    return [path] + ([path + "i"] if path.endswith(".py") and os.path.exists(path + "i") else [])


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


def _imports(tree: ast.Module) -> List[ast.stmt]:
    """Every import statement of the module, wherever it stands: the body,
    ``if TYPE_CHECKING:`` and ``try`` blocks, functions, methods, classes."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _dynamic_imports(tree: ast.Module) -> List[str]:
    """The modules a module imports by name at run time:
    ``importlib.import_module("streamcoll.x")`` and ``__import__(...)`` with
    a literal name, or an f-string's literal start
    (``f"streamcoll._ffi.{name}"`` imports a module of ``streamcoll._ffi``)."""
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and n.args):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name not in ("import_module", "__import__"):
            continue
        a = n.args[0]
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            out.append(a.value)
        elif isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.Constant):
            out.append(str(a.values[0].value).rstrip("."))
    return out


def _graph(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    g: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if os.path.basename(path).startswith("__init__.") else m.rsplit(".", 1)[0]
        nodes: List[ast.stmt] = []
        for src in _sources(path):
            with open(src, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), src)
            nodes += _imports(tree)
            # an import by name (importlib) ties the modules as a statement does
            g[m].update(t for t in _dynamic_imports(tree) if t in mods and t != m)
        for n in nodes:
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


def test_no_import_circle():
    """Function-level imports count: one that closes a circle is what made
    the core depend on its observers (issue 44). ``TYPE_CHECKING`` imports
    count too: a type checker follows them."""
    g = _graph(_modules())
    assert g["streamcoll.core.communicator"] >= {"streamcoll.core.p2p", "streamcoll.core.fast_paths"}  # the graph is read
    assert "streamcoll.integrations.process_group" in g["streamcoll"]  # and the package face's imports
    circles = _circles(g)
    assert circles == [], "import circles (every import counted): " + "; ".join(
        " ".join(sorted(m.replace("streamcoll.", "") for m in c)) for c in circles)


# The layers, lowest first, one subpackage each: a module imports only
# modules of its own layer or lower ones. binding (streamcoll._ffi): the C
# declarations, the library loaders and the exception family they raise;
# core: what launches collectives, records them and checks them before the
# launch; diagnostics: what observes the core (the watchdog, flight dumps and
# their analysis, signals, /dev/shm cleanup), attached through
# streamcoll.core.hooks; start-up: finding the ranks, the hosts and the
# environment, and making a communicator; integrations: torch.distributed's
# process group, torch.compile's ops, DDP-style gradient sync; face: the
# package, its commands and the benchmark tools.
ORDER = ["binding", "core", "diagnostics", "start-up", "integrations", "face"]
LAYERS: Dict[str, str] = {
    "streamcoll._ffi": "binding",  # each entry covers every module under it
    "streamcoll._native": "binding",
    "streamcoll.core": "core",
    "streamcoll.diagnostics": "diagnostics",
    "streamcoll.startup": "start-up",
    "streamcoll.integrations": "integrations",
    "streamcoll": "face",
    "streamcoll.__main__": "face",
    "streamcoll.collectives": "face",
    "streamcoll.flight": "face",
    "streamcoll._stubgen": "face",
    "streamcoll.bench": "face",
}


def _layer(m: str) -> str:
    """``m``'s layer: its own entry, else its nearest package's."""
    name = m
    while name not in LAYERS and "." in name:
        name = name.rsplit(".", 1)[0]
    if name == "streamcoll" and m != "streamcoll":
        return ""  # a module of the package that LAYERS does not place
    return LAYERS.get(name, "")


def test_every_module_has_a_layer():
    mods = _modules()
    unplaced = sorted(m for m in mods if not _layer(m))
    assert unplaced == [], f"modules without a layer (add them to LAYERS, where they belong): {unplaced}"
    assert sorted(m for m in LAYERS if m not in mods) == [], "LAYERS names modules that do not exist"
    assert set(LAYERS.values()) <= set(ORDER)


def test_no_module_imports_a_higher_layer():
    """The core never imports the diagnostics (they attach to it through
    streamcoll.core.hooks), nothing below start-up imports it, and so on up."""
    g = _graph(_modules())
    up = sorted(f"{m} ({_layer(m)}) -> {t} ({_layer(t)})" for m, ts in g.items() for t in ts
                if _layer(m) and _layer(t) and ORDER.index(_layer(t)) > ORDER.index(_layer(m)))
    assert up == [], "imports of a higher layer:\n" + "\n".join(up)


def test_observers_attach_whichever_module_is_imported_first():
    """The core calls the watchdog and torch-format dumps through
    streamcoll.core.hooks, never by import: importing a core module alone (which
    runs the package's __init__ first) must find every slot filled, so no
    communicator is created unwatched. ``python -m streamcoll.flight`` still
    runs without the runpy warning (the package does not import flight)."""
    code = ("import sys, warnings\n"
            "warnings.simplefilter('error')\n"
            "import streamcoll.core.communicator\n"
            "from streamcoll.core import hooks\n"
            "from streamcoll.diagnostics import watchdog, fr_torch\n"
            "assert hooks.on_create == [watchdog.register], hooks.on_create\n"
            "assert hooks.on_timeout is watchdog.handle_timeout\n"
            "assert hooks.teardown_guard is watchdog.skip_native_teardown\n"
            "assert hooks.on_dump == [fr_torch._after_dump], hooks.on_dump\n"
            "assert 'streamcoll.diagnostics.flight' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "streamcoll.flight", "--help"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "RuntimeWarning" not in p.stderr, p.stderr[-3000:]


_HALF = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
try:
    import streamcoll
    raise SystemExit("import streamcoll did not fail")
except ImportError:
    pass
# what a failed package import leaves importable (sys.modules keeps the submodules it loaded)
from streamcoll.core.communicator import Communicator
from streamcoll.core import hooks
print(len(hooks.on_create), len(hooks.on_dump), hooks.on_timeout.__name__, hooks.teardown_guard.__name__)
"""


@pytest.mark.parametrize("fails", ["streamcoll.startup.launchers", "streamcoll.collectives",
                                   "streamcoll.integrations.process_group"])
def test_a_package_import_failing_halfway_leaves_no_core_without_its_observers(fails):
    """``import streamcoll`` failing after the core loaded (a module of a
    higher layer fails on this torch) leaves the core in ``sys.modules``:
    ``from streamcoll.core.communicator import Communicator`` then works
    without the package. The observers attach before anything above them
    can fail, so such a core is never unwatched."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _HALF, fails], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["1", "1", "handle_timeout", "skip_native_teardown"], (fails, p.stdout)


def _plant(tmp_path, files: Dict[str, str]) -> Dict[str, str]:
    """A copy of the package's module table with ``files`` (relative path ->
    source) written under ``tmp_path`` in their place."""
    mods = _modules()
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
        mods[rel[:-3].replace("/", ".").replace(os.sep, ".")] = str(p)
    return mods


def test_the_checks_fail_on_a_back_up_arrow_and_a_circle_made_in_a_function(tmp_path):
    """The checks see what issue 44's tree had: a core module that imports a
    diagnostic inside a function (a back-up arrow), and two modules that
    import each other only at run time (a circle)."""
    core = open(_modules()["streamcoll.core.spec"], encoding="utf-8").read()
    mods = _plant(tmp_path, {"streamcoll/core/spec.py": core + "\n\ndef _late():\n    from ..diagnostics import watchdog\n"})
    g = _graph(mods)
    assert "streamcoll.diagnostics.watchdog" in g["streamcoll.core.spec"]
    assert ORDER.index(_layer("streamcoll.diagnostics.watchdog")) > ORDER.index(_layer("streamcoll.core.spec"))
    assert _circles(g), "spec -> watchdog -> ... -> spec is a circle"
    mods = _plant(tmp_path, {"streamcoll/core/ops.py": open(_modules()["streamcoll.core.ops"]).read()
                             + "\n\nif False:\n    from .validation import check_op\n"})
    g = _graph(mods)
    assert "streamcoll.core.validation" in g["streamcoll.core.ops"]
    # an import by name: importlib with a literal, or an f-string's literal start
    mods = _plant(tmp_path, {"streamcoll/core/ops.py": open(_modules()["streamcoll.core.ops"]).read()
                             + "\n\ndef _late(x):\n    import importlib\n"
                             "    importlib.import_module('streamcoll.diagnostics.watchdog')\n"
                             "    return importlib.import_module(f'streamcoll.startup.{x}')\n"})
    g = _graph(mods)
    assert {"streamcoll.diagnostics.watchdog", "streamcoll.startup"} <= g["streamcoll.core.ops"]
    assert g["streamcoll.__main__"] >= {"streamcoll._ffi"}  # info's binding by name


def test_the_checks_read_a_module_beside_its_stub(tmp_path):
    """A module with a stub (collectives.py, core/_methods.py) is checked by
    its own imports too, not only by its stub's: a back-up arrow made in
    core/_methods.py and a circle closed through collectives.py are seen."""
    g = _graph(_modules())
    assert {"streamcoll.startup.bootstrap", "streamcoll.integrations.custom_ops"} <= g["streamcoll.collectives"]
    import shutil
    shutil.copytree(PKG, tmp_path / "streamcoll", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "streamcoll" / "core" / "_methods.py", "a") as f:
        f.write("\n\ndef _late():\n    from ..diagnostics import watchdog\n")
    with open(tmp_path / "streamcoll" / "diagnostics" / "flight.py", "a") as f:
        f.write("\n\ndef _late():\n    from .. import collectives\n")
    with open(tmp_path / "streamcoll" / "collectives.py", "a") as f:
        f.write("\n\ndef _late():\n    from .diagnostics import flight\n")
    g = _graph(_modules(str(tmp_path)))
    assert "streamcoll.diagnostics.watchdog" in g["streamcoll.core._methods"]
    assert any({"streamcoll.collectives", "streamcoll.diagnostics.flight"} <= set(c) for c in _circles(g))


_DOTTED = r"(?<![\w.])streamcoll(?:\.[A-Za-z_]\w*)+"


def _name_problem(name: str) -> str:
    """Why the dotted ``name`` does not resolve, walked as Python does:
    attributes of the package, a submodule imported where the attribute is
    not there; "" when it does. A module must come from this checkout: an
    editable install of another checkout (its finder answers for any
    ``streamcoll.x`` this one lacks) would resolve a name of the old layout
    to that checkout's file."""
    import importlib.util
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        prefix = ".".join(parts[: i + 1])
        spec = importlib.util.find_spec(prefix) if hasattr(obj, "__path__") else None  # a package's submodule
        if spec is None:
            return f"{'.'.join(parts[:i])} has no {parts[i]!r}"
        if not os.path.abspath(spec.origin or "").startswith(PKG + os.sep):  # looked up, not run
            return f"{prefix} is {spec.origin}, not this checkout's"
        obj = importlib.import_module(prefix)
    return ""


def test_every_dotted_name_of_the_package_resolves():
    """Every ``streamcoll.x.y`` written in the package (docstrings, comments,
    code), the tests, the docs, the examples, the benchmarks and the scripts
    names a module or an attribute that exists: a rename the layout's
    rewrite missed or mangled is found here. Logger names that are not
    modules (``streamcoll.shm``) and torch's op namespace (``torch.ops.streamcoll``)
    are not module names."""
    import re
    loggers = set()
    where: Dict[str, str] = {}
    for top in ("streamcoll", "tests", "docs", "examples", "benchmarks", "scripts"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "results")]
            for f in files:
                if not f.endswith((".py", ".pyi", ".md", ".sh", ".h")):
                    continue
                path = os.path.join(d, f)
                if os.path.samefile(path, __file__):
                    continue  # its own examples of names that do not resolve
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                loggers.update(re.findall(r"getLogger\(\"(streamcoll[\w.]*)\"\)", text))
                for m in re.finditer(_DOTTED, text):
                    where.setdefault(m.group(0), os.path.relpath(path, ROOT))
    for f in ("README.md", "streamcoll_autoload.py"):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            text = fh.read()
        loggers.update(re.findall(r"getLogger\(\"(streamcoll[\w.]*)\"\)", text))
        for m in re.finditer(_DOTTED, text):
            where.setdefault(m.group(0), f)
    assert "streamcoll.core.hooks" in where and "streamcoll.diagnostics.watchdog.handle_timeout" in where  # read
    bad = sorted(f"{n} ({where[n]}): {_name_problem(n)}" for n in where
                 if n not in loggers and _name_problem(n))
    assert bad == [], "dotted names that do not resolve:\n" + "\n".join(bad)
    assert _name_problem("streamcoll.diagnostics.watchdg.register") and _name_problem("streamcoll.core.hooks.on_crate")
    assert _name_problem("streamcoll.debug.signatures_for")  # the flat layout's name (core/checks.py now)


SUBPACKAGES = ["streamcoll._ffi", "streamcoll.core", "streamcoll.diagnostics", "streamcoll.startup",
               "streamcoll.integrations"]


def test_each_subpackage_says_its_job_in_two_lines_and_imports_nothing():
    """Importing one module of a subpackage must not import its siblings (the
    package's import order is the face's), and its folder says what it holds."""
    mods = _modules()
    for sub in SUBPACKAGES:
        with open(mods[sub], encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        doc = ast.get_docstring(tree) or ""
        assert 1 <= len(doc.splitlines()) <= 2, f"{sub}: its docstring says its job in two lines: {doc!r}"
        assert _imports(tree) == [] and _dynamic_imports(tree) == [], f"{sub}/__init__.py imports"


def test_no_issue_numbers_in_the_library():
    """The why lives in the code and docs/, not in a tracker reference."""
    import re
    found = []
    for m, path in _modules().items():
        for src in _sources(path):
            with open(src, encoding="utf-8") as fh:
                for i, line in enumerate(fh, 1):
                    if re.search(r"\bissues? #?\d+", line, re.IGNORECASE):
                        found.append(f"{os.path.relpath(src, ROOT)}:{i}")
    assert found == [], f"issue numbers in library code: {found}"
