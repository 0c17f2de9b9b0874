"""The README and ``docs/`` stay true to the tree (issue 37): every file path
they mention exists in the repository, every relative markdown link (and its
``#anchor``) resolves, and every ``python -m streamcoll...`` command in their
code parses its arguments with the package's own parser, stopped right after
parsing (nothing runs). Pure logic, no processes.

A path is a token of inline code or of a code block that starts with one of
the repository's top-level folders (``streamcoll/``, ``tests/``, ...), names a
file at the root (``setup.cfg``), or is a bare file name with a source or
result extension standing alone in an inline span (``communicator.py``: it
must exist somewhere in the tree).
Globs (``examples/launch_*.py``) and braces (``{all,focus}.txt``) must match
something; an ``--out`` prefix (``benchmarks/results/sweep_2ranks_mpi``) must
prefix files. Untracked outputs (``bench-results/``, ``.venv-mpi/``) and
other projects' paths (``doc/PERFORMANCE.md``, ``include/oneapi/ccl.h``) do
not start with a top-level folder of this repository, so they are not
checked."""
from __future__ import annotations

import argparse
import fnmatch
import glob
import itertools
import os
import re
import runpy
import shlex
import sys
from typing import Dict, Iterator, List, Tuple

import pytest

from conftest import ROOT

#: The tracked top-level folders; a path in the docs that starts with one of
#: them is this repository's.
TOP_DIRS = ("streamcoll", "tests", "scripts", "benchmarks", "examples", "native", "docs", ".ci")
ROOT_FILES = ("README.md", "setup.cfg", "pyproject.toml", "MANIFEST.in", "streamcoll_autoload.py")
#: Extensions of a bare file name that must exist somewhere in the tree.
BARE_EXT = ("py", "pyi", "sh", "md", "h", "c", "txt", "json", "png", "cfg", "toml")
#: Folders never searched for a bare name (outputs, environments, git).
SKIP_DIRS = {".git", "bench-results", "build", "dist", "__pycache__", ".pytest_cache"}


def pages() -> List[str]:
    """The pages checked, relative to the root: the README, every page of
    ``docs/`` and the benchmarks' pointer."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + docs + [os.path.join("benchmarks", "README.md")]


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)


def code_blocks(text: str) -> List[str]:
    return _FENCE.findall(text)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return _FENCE.sub("", text)


def inline_code(text: str) -> List[str]:
    """Inline code spans outside code blocks, whitespace (a span may wrap a
    line) made single spaces."""
    return [" ".join(m.group(2).split()) for m in _INLINE.finditer(prose(text))]


# ------------------------------------------------------------------ paths
_TOKEN = re.compile(r"[A-Za-z0-9_.\-/*{},\[\]]+")


def _expand_braces(token: str) -> List[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return list(itertools.chain.from_iterable(
        _expand_braces(token[:m.start()] + alt + token[m.end():]) for alt in m.group(1).split(",")))


def path_tokens(code: str, bare: bool = True) -> Iterator[str]:
    """The tokens of ``code`` that name a path of this repository (bare file
    names too, unless ``bare`` is False)."""
    for token in _TOKEN.findall(code):
        token = token.strip(".,:;")
        if token.startswith("./"):
            token = token[2:]
        head = token.split("/", 1)[0]
        if "/" in token or token in TOP_DIRS:
            if head in TOP_DIRS:
                yield token
        elif token in ROOT_FILES:
            yield token
        elif bare and re.fullmatch(r"[\w\-*]+\.(%s)" % "|".join(BARE_EXT), token) \
                and not token.split(".")[0].isupper():
            yield token


_tree_names: Dict[str, List[str]] = {}


def _names_in_tree() -> Dict[str, List[str]]:
    if not _tree_names:
        for dirpath, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
            for f in files:
                _tree_names.setdefault(f, []).append(os.path.join(dirpath, f))
    return _tree_names


def path_problem(token: str) -> str:
    """Why ``token`` (a path as the docs write it, relative to the root) names
    nothing; ``""`` when it names something."""
    for one in _expand_braces(token):
        if "/" not in one and one not in TOP_DIRS and one not in ROOT_FILES:  # a bare file name
            names = _names_in_tree()
            if not (one in names or ("*" in one and any(fnmatch.fnmatch(n, one) for n in names))):
                return f"{one}: no file of that name in the repository"
            continue
        full = os.path.join(ROOT, one)
        if any(c in one for c in "*?["):
            if not glob.glob(full):
                return f"{one}: the pattern matches nothing"
        elif not (os.path.exists(full) or glob.glob(glob.escape(full) + ".*")):
            return f"{one}: no such file or folder (nor files with it as a prefix)"
    return ""


def mentioned_paths(text: str) -> List[str]:
    """Paths in inline code and code blocks; a bare file name only where it
    is a span of its own (in a command, ``torchrun ... your_job.py``, it is
    the reader's file)."""
    out = []
    for code in inline_code(text):
        out.extend(path_tokens(code, bare=" " not in code))
    for code in code_blocks(text):
        out.extend(path_tokens(code, bare=False))
    return out


@pytest.mark.parametrize("page", pages())
def test_every_path_a_page_mentions_exists(page):
    text = read(page)
    found = mentioned_paths(text)
    bad = sorted({p for p in (path_problem(t) for t in found) if p})
    assert not bad, f"{page} mentions paths that are not in the repository:\n  " + "\n  ".join(bad)


def test_the_pages_mention_paths_at_all():
    """The extraction finds what it must (a checker that finds nothing passes
    everything)."""
    readme = set(mentioned_paths(read("README.md")))
    assert {"scripts/test.sh", "examples/launch_job.py"} <= readme, readme
    assert "benchmarks/results/sweep_2ranks_mpi.txt" in mentioned_paths(read("docs/benchmarks.md"))


def test_a_broken_path_is_found():
    assert path_problem("tests/core/test_no_such_module.py")
    assert path_problem("examples/no_such_*.py")
    assert path_problem("benchmarks/results/multihost/{all,no_such_run}.txt")
    assert path_problem("no_such_module.py")
    assert not path_problem("examples/launch_*.py")
    assert not path_problem("benchmarks/results/sweep_2ranks_mpi")  # an --out prefix
    assert not path_problem("streamcoll/_ffi/")
    text = ("See `tests/core/test_no_such_module.py`, `torchrun job.py` and\n"
            "```sh\npython scripts/no_such.sh my_job.py\n```\n")
    assert [t for t in mentioned_paths(text) if path_problem(t)] == ["tests/core/test_no_such_module.py",
                                                                           "scripts/no_such.sh"]
    assert mentioned_paths("`bench-results/` `doc/PERFORMANCE.md` `/dev/shm` `PREFIX.txt`") == []


# ------------------------------------------------------------------ links
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased,
    punctuation but ``-`` and ``_`` dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    seen: Dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose(text), re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str) -> List[str]:
    """Link and image targets outside code."""
    return _LINK.findall(_INLINE.sub("", prose(text)))


def link_problem(page: str, target: str) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return ""
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
    if not (full + os.sep).startswith(ROOT + os.sep):
        return f"{target}: outside the repository"
    if not os.path.exists(full):
        return f"{target}: {os.path.relpath(full, ROOT)} does not exist"
    if anchor and full.endswith(".md"):
        with open(full) as f:
            if anchor not in anchors(f.read()):
                return f"{target}: no heading #{anchor} in {os.path.relpath(full, ROOT)}"
    return ""


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_resolves(page):
    bad = [p for p in (link_problem(page, t) for t in links(read(page))) if p]
    assert not bad, f"{page} has links that do not resolve:\n  " + "\n  ".join(bad)


def test_a_broken_link_is_found():
    assert links("[a](docs/x.md#y) ![i](p.png) `[c](code)`\n```\n[d](block)\n```\n") == ["docs/x.md#y", "p.png"]
    assert link_problem("README.md", "docs/no_such_page.md")
    assert link_problem("README.md", "docs/design.md#no-such-heading")
    assert link_problem("docs/design.md", "../README.md#no-such-heading")
    assert not link_problem("docs/design.md", "../README.md")
    assert not link_problem("README.md", "https://example.org/x")
    assert slug("Several hosts (`benchmarks/multihost.py`, issues 13 and 25)") == \
        "several-hosts-benchmarksmultihostpy-issues-13-and-25"
    assert slug("After `abort()`") == "after-abort"


# ------------------------------------------------------------------ commands
_COMMAND = re.compile(r"\bpython3? -m (streamcoll[\w.]*)(.*)")


def commands(text: str) -> List[Tuple[str, List[str]]]:
    """``(module, argv)`` of every ``python -m streamcoll...`` in the code of
    a page: each line of a code block (comments dropped), each inline span;
    the arguments end at a shell operator."""
    lines = [line.split(" #", 1)[0] for block in code_blocks(text) for line in block.splitlines()]
    out = []
    for line in lines + inline_code(text):
        for m in _COMMAND.finditer(line):
            argv = []
            for word in shlex.split(m.group(2), comments=True):
                if word in ("|", "||", "&&", ";", "&") or re.match(r"^\d?>", word):
                    break
                argv.append(word)
            out.append((m.group(1), argv))
    return out


class _Parsed(Exception):
    pass


def parse_only(module: str, argv: List[str]) -> argparse.Namespace:
    """What ``python -m module argv...`` parses, with the module's own parser:
    its code runs as ``__main__`` up to its ``parse_args``, which returns
    into an exception here, so the command itself never runs. A parse error
    (argparse's exit 2) fails with argparse's message."""
    real = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args = stop  # type: ignore[method-assign]
    sys.argv = [f"python -m {module}"] + list(argv)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed as p:
        return p.args[0]
    except SystemExit as e:
        raise AssertionError(f"python -m {module} {shlex.join(argv)}: argparse exits {e.code}") from None
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
        sys.argv = saved_argv
    raise AssertionError(f"python -m {module} {shlex.join(argv)}: ended without parsing its arguments")


def test_the_pages_have_commands():
    everything = [c for page in pages() for c in commands(read(page))]
    assert ("streamcoll", ["info"]) in everything and ("streamcoll", ["install-runtime"]) in everything
    assert any(m == "streamcoll.flight" for m, _ in everything)


@pytest.mark.parametrize("page", pages())
def test_every_streamcoll_command_parses(page, capsys):
    for module, argv in commands(read(page)):
        parse_only(module, argv)


def test_a_bad_command_is_found(capsys):
    assert parse_only("streamcoll", ["install-runtime", "--force"]).force is True
    assert parse_only("streamcoll.flight", ["analyze", "DIR"]).paths == ["DIR"]
    with pytest.raises(AssertionError, match="argparse exits 2"):
        parse_only("streamcoll", ["install-runtime", "--no-such-option"])
    with pytest.raises(AssertionError, match="argparse exits 2"):
        parse_only("streamcoll", ["no-such-command"])
    assert commands("`python -m streamcoll\ninstall-runtime --force` and\n```sh\n"
                    "X=1 python -m streamcoll.bench --sizes 4K 2>/dev/null   # note\n```\n") == \
        [("streamcoll.bench", ["--sizes", "4K"]), ("streamcoll", ["install-runtime", "--force"])]
