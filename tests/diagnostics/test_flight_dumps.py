"""Flight-record dumps are private and written safely (issue 26): the default
directory is this user's own (``$XDG_RUNTIME_DIR/streamcoll-flight``, else
``<tmp>/streamcoll-flight-<uid>``), made 0700; one that is a symlink, not a
directory or another user's is refused with a warning naming it, and the dump
goes to a new private directory; dumps are 0600 files created with
``O_EXCL|O_NOFOLLOW`` and renamed into place, so nothing is written through a
planted link."""
from __future__ import annotations

import json
import logging
import os
import stat
import tempfile

import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll.diagnostics import flight
from streamcoll.core import recorder

from conftest import needs_oneccl

UID = os.geteuid()


@pytest.fixture(scope="module")
def comm():
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore(),
                                    name="dumps")
    c.all_reduce(torch.ones(4))
    yield c
    c.destroy()


@pytest.fixture
def tmp_default(monkeypatch, tmp_path):
    """``<tmp>`` is ``tmp_path``; no XDG_RUNTIME_DIR, no STREAMCOLL_FLIGHT_DIR;
    the umask most systems have (022)."""
    monkeypatch.delenv("STREAMCOLL_FLIGHT_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0o022)
    yield tmp_path
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_default_dir_is_per_user(tmp_default, monkeypatch):
    assert recorder.default_dir() == os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    run = tmp_default / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert recorder.default_dir() == os.path.join(str(run), "streamcoll-flight")
    run.chmod(0o755)  # not a private runtime directory (e.g. another user's, left by su): not used
    assert recorder.default_dir() == os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    monkeypatch.setenv("STREAMCOLL_FLIGHT_DIR", str(tmp_default / "mine"))
    assert recorder.default_dir() == str(tmp_default / "mine")


@needs_oneccl
def test_default_dump_is_private(comm, tmp_default):
    path = flight.dump(comm)
    d = os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    assert path == os.path.join(d, "dumps.rank0.json")
    assert _mode(d) == 0o700 and _mode(path) == 0o600
    assert json.loads(open(path).read())["communicator"] == "dumps"
    assert os.listdir(d) == ["dumps.rank0.json"]  # no temporary file left
    # a second dump replaces the first, same modes
    assert flight.dump(comm) == path and _mode(path) == 0o600 and os.listdir(d) == ["dumps.rank0.json"]


@needs_oneccl
def test_own_directory_with_loose_modes_is_tightened(comm, tmp_default):
    d = os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    os.mkdir(d, 0o755)
    os.chmod(d, 0o755)
    flight.dump(comm)
    assert _mode(d) == 0o700


def _refused(caplog, planted: str, path: str) -> None:
    assert not path.startswith(planted + os.sep), path
    fresh = os.path.dirname(path)
    st = os.lstat(fresh)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == UID and _mode(fresh) == 0o700, fresh
    assert _mode(path) == 0o600
    assert f"{planted}" in caplog.text and "refused" in caplog.text and fresh in caplog.text, caplog.text


@needs_oneccl
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another user")
def test_a_directory_of_another_user_is_refused(comm, tmp_default, caplog):
    planted = os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    os.mkdir(planted)
    os.chmod(planted, 0o777)
    os.chown(planted, 65534, 65534)  # nobody
    with caplog.at_level(logging.WARNING, logger="streamcoll.flight"):
        path = flight.dump(comm)
    assert os.listdir(planted) == [], os.listdir(planted)
    _refused(caplog, planted, path)
    assert "owned by uid 65534" in caplog.text, caplog.text


@needs_oneccl
def test_a_planted_symlink_is_refused(comm, tmp_default, caplog):
    target = tmp_default / "theirs"
    target.mkdir()
    planted = os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    os.symlink(str(target), planted)
    with caplog.at_level(logging.WARNING, logger="streamcoll.flight"):
        path = flight.dump(comm)
    assert os.listdir(target) == [], "written through the planted link"
    _refused(caplog, planted, path)
    assert "symbolic link" in caplog.text, caplog.text


@needs_oneccl
def test_not_a_directory_is_refused(comm, tmp_default, caplog):
    planted = os.path.join(str(tmp_default), f"streamcoll-flight-{UID}")
    with open(planted, "w") as f:
        f.write("x")
    with caplog.at_level(logging.WARNING, logger="streamcoll.flight"):
        path = flight.dump(comm)
    assert open(planted).read() == "x"
    _refused(caplog, planted, path)
    assert "not a directory" in caplog.text, caplog.text


@needs_oneccl
def test_a_link_planted_at_the_dump_name_is_replaced_not_followed(comm, tmp_path):
    """In a directory the user chose (``path=``, ``STREAMCOLL_FLIGHT_DIR``),
    a link at the dump's name or at a temporary name is never written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = tmp_path / "dumps"
    d.mkdir()
    os.symlink(str(victim), str(d / "dumps.rank0.json"))
    for i in range(4):  # the old writer's temporary name, and a few more
        os.symlink(str(victim), str(d / f"dumps.rank0.json.{os.getpid() + i}.tmp"))
    path = comm.dump_flight_record(str(d))
    assert victim.read_text() == "keep"
    assert path == str(d / "dumps.rank0.json") and not os.path.islink(path) and _mode(path) == 0o600
    assert json.loads(open(path).read())["rank"] == 0
