"""install-runtime's file handling (issue 20), on real files and real
processes, without the package index: the extraction of wheel members and
the swap of the assembled runtime into place."""
from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time
import zipfile
from pathlib import Path

import pytest

from streamcoll.startup import install


def _wheel(path: Path, members) -> Path:
    """A zip with ``members``: (name, mode, data)."""
    with zipfile.ZipFile(path, "w") as z:
        for name, mode, data in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, data)
    return path


@pytest.mark.parametrize("member", ["oneccl-2022.2.0.data/data/include/../../x",
                                    "oneccl-2022.2.0.data/data/include/../../../x",
                                    "oneccl-2022.2.0.data/data/include//abs/../../../x"])
def test_a_member_that_leaves_the_destination_is_refused(tmp_path, member):
    """Before: ``include/../../x`` was written beside the destination."""
    dest = tmp_path / "a" / "dest"
    dest.mkdir(parents=True)
    whl = _wheel(tmp_path / "w.whl", [("oneccl-2022.2.0.data/data/include/ok.h", 0o644, b"ok"),
                                      (member, 0o644, b"evil")])
    with pytest.raises(install.InstallError) as ei:
        install._extract(whl, ["include/"], dest)
    assert member in str(ei.value) and "outside" in str(ei.value), str(ei.value)
    outside = [p for p in tmp_path.rglob("x")]
    assert outside == [], outside


def test_modes_follow_the_umask(tmp_path):
    """A 0777 member does not become world-writable under ~/.cache: modes
    are 0666 or 0777 (executable) less the umask, as any file created here
    (before: the wheel's bits, umask ignored)."""
    old = os.umask(0o022)
    try:
        whl = _wheel(tmp_path / "w.whl", [("p.data/data/lib/libx.so", 0o777, b"x"),
                                          ("p.data/data/include/a.h", 0o666, b"h")])
        got = install._extract(whl, ["lib/", "include/"], tmp_path / "d")
    finally:
        os.umask(old)
    assert sorted(got) == ["include/a.h", "lib/libx.so"]
    assert stat.S_IMODE((tmp_path / "d/lib/libx.so").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "d/include/a.h").stat().st_mode) == 0o644


def _swapper(root: str, n: int, tag: int, q) -> None:
    try:
        for i in range(n):
            new = Path(root).parent / f"new-{tag}-{i}"
            (new / "lib").mkdir(parents=True)
            (new / "lib" / "libccl.so.2").write_text(f"{tag}-{i}")
            install._swap_in(new, Path(root))
        q.put(("ok", tag))
    except BaseException as e:  # noqa: BLE001 - back to the test
        q.put(("error", f"{type(e).__name__}: {e}"))


def test_concurrent_swaps_neither_fail_nor_leave_the_runtime_absent(tmp_path):
    """Three processes swap runtimes in at once, 30 times each, while this
    one keeps looking: no swap fails, the runtime is never absent and
    nothing is left behind (before: 'OSError: Directory not empty',
    ``oneccl.old-PID`` left, the folder briefly gone)."""
    root = tmp_path / "oneccl"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libccl.so.2").write_text("first")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_swapper, args=(str(root), 30, t, q)) for t in range(3)]
    for p in procs:
        p.start()
    absent = 0
    looks = 0
    while any(p.is_alive() for p in procs):
        looks += 1
        if not (root / "lib" / "libccl.so.2").exists():
            absent += 1
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(r[0] == "ok" for r in results), results
    assert absent == 0, f"absent {absent} times of {looks}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oneccl"], list(tmp_path.iterdir())


def _hold(path: str, q) -> None:
    with install._locked(Path(path)):
        q.put(("in", time.monotonic()))
        time.sleep(0.4)
        q.put(("out", time.monotonic()))


def test_installs_take_turns(tmp_path):
    """Two installs at once: the second waits for the first's lock."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(str(tmp_path / "oneccl"), q)) for _ in range(2)]
    for p in procs:
        p.start()
    events = sorted([q.get(timeout=60) for _ in range(4)], key=lambda e: e[1])
    for p in procs:
        p.join(30)
    assert [e[0] for e in events] == ["in", "out", "in", "out"], events
