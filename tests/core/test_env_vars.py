"""One table of environment variables (issue 15): every STREAMCOLL_ variable
the code reads is in it, ``info`` prints it, and docs/backends-and-defaults.md
shows it (the README links there)."""
from __future__ import annotations

import io
import os
import re

from streamcoll.core import env_vars

from conftest import ROOT


def test_every_streamcoll_variable_in_the_code_is_in_the_table():
    found = set()
    pkg = os.path.join(ROOT, "streamcoll")
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    found |= set(re.findall(r"\b(STREAMCOLL_[A-Z_]+[A-Z])\b", fh.read()))
    assert found - set(env_vars.names()) == set(), found - set(env_vars.names())
    assert len(env_vars.names()) == len(set(env_vars.names()))


#: The page that shows the table (the README links to it).
TABLE_PAGE = os.path.join("docs", "backends-and-defaults.md")


def test_docs_table_is_the_rendered_table():
    with open(os.path.join(ROOT, TABLE_PAGE)) as f:
        page = f.read()
    m = re.search(r"<!-- env-table[^>]*-->\n(.*?)<!-- /env-table -->", page, re.S)
    assert m, f"{TABLE_PAGE} has no env-table section"
    assert m.group(1) == env_vars.markdown(), f"{TABLE_PAGE}'s table is stale: render env_vars.markdown() into it"


def test_info_prints_every_variable(monkeypatch):
    from streamcoll.__main__ import info
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    out = io.StringIO()
    assert info(out) == 0
    text = out.getvalue()
    for name in env_vars.names():
        assert re.search(rf"^  {name}(=| \(not set\))", text, re.M), name
    assert "  STREAMCOLL_WATCHDOG=fail\n" in text
    assert "  STREAMCOLL_FLIGHT_SIZE (not set) [streamcoll, default 1024]" in text


def test_each_streamcoll_variable_says_whether_ranks_must_agree():
    """Issue 42, finding 5: each of streamcoll's variables says whether it
    must be equal on every rank (checked at the rendezvous, as oneCCL's
    are) or may differ between ranks, and the table's "checked" ones are
    exactly those streamcoll.startup.env_defaults agrees: its native ones and its own."""
    from streamcoll.startup import env_defaults as env
    checked = {v.name for v in env_vars.TABLE if "equal on every rank (checked" in v.doc}
    agreed = set(env.MUST_AGREE) | {name for own in env.OWN.values() for name in own.variables}
    assert checked == agreed, checked ^ agreed
    for v in env_vars.TABLE:
        if v.name.startswith("STREAMCOLL_"):
            says = ("equal on every rank (checked" in v.doc, "may differ between ranks" in v.doc)
            assert says in ((True, False), (False, True)), (v.name, v.doc)
