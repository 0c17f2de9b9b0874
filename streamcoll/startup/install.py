"""``python -m streamcoll install-runtime``: the oneCCL CPU runtime, assembled
from the package index into streamcoll's cache, then checked.

Why assemble instead of ``pip install oneccl``: oneCCL 2022.2.0's wheels
declare ``Requires-Dist: libfabric (>=2.6)``, which PyPI does not have, and
no single wheel holds a working CPU set. ``oneccl-cpu`` has the CPU
``libccl.so.1`` but no C API front; ``oneccl`` has the front
(``libccl.so.2``) and the CPU plugin (``libccl_legacy_cpu.so``) but a SYCL
``libccl.so.1`` that needs Intel's ``libsycl``; installed together into one
prefix, the SYCL file wins and nothing loads. So the three wheels are fetched
with ``pip download --no-deps`` and the working set is copied into one folder:

- ``lib/libccl.so.1`` from ``oneccl-cpu``;
- ``lib/libccl.so.2`` and ``lib/libccl_legacy_cpu.so`` from ``oneccl``;
- ``include/`` from ``oneccl-cpu-devel`` (for the ABI check and C users).

The folder is ``$STREAMCOLL_HOME/oneccl`` (default
``~/.cache/streamcoll/oneccl``), a place the loader searches
(streamcoll/_ffi/oneccl.py). It is built beside the old one and swapped in,
so a half-done install never shadows a working runtime.

oneCCL's transport is libfabric (``libfabric.so.1``), which it dlopens by name:
``LD_LIBRARY_PATH``, then the folder of ``libccl.so.1`` (its RUNPATH is
``$ORIGIN``), then the system. ``--libfabric auto`` (the default) keeps the
system's where one loads (Debian: ``libfabric1``) and otherwise puts the
``libfabric.so.1`` of the ``mpich`` 5.0.2 wheel (libfabric 2.5.1, no root
needed) beside ``libccl.so.1``; ``pip`` always does, ``system`` never does.
Where neither is possible it prints the apt command.

The result is verified the way a job uses it: a fresh interpreter loads that
folder (``$STREAMCOLL_ONECCL_LIBRARY``) and creates a one-rank communicator
and all-reduces. Running it again is quick: what is complete is not
downloaded again, and the check runs each time.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .._ffi._common import runtime_home

__all__ = ["ONECCL_VERSION", "MPICH_VERSION", "InstallError", "Runtime", "install_runtime", "main"]

ONECCL_VERSION = "2022.2.0"
MPICH_VERSION = "5.0.2"
LIBFABRIC_MODES = ("auto", "system", "pip")
APT_COMMAND = "sudo apt-get install -y libfabric1"
DESCRIPTION = (f"Assemble the oneCCL {ONECCL_VERSION} CPU runtime from the package index into "
               "$STREAMCOLL_HOME/oneccl (default ~/.cache/streamcoll/oneccl) and check it with a "
               "one-rank communicator. Idempotent.")

# (project, files taken from its <prefix>/ data: a name ending in "/" is a folder)
_PARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("oneccl-cpu", ("lib/libccl.so.1",)),
    ("oneccl", ("lib/libccl.so.2", "lib/libccl_legacy_cpu.so")),
    ("oneccl-cpu-devel", ("include/",)),
)
_REQUIRED = ("lib/libccl.so.1", "lib/libccl.so.2", "lib/libccl_legacy_cpu.so", "include/oneapi/ccl.h")
_MPICH_LIBFABRIC = "lib/mpich/libfabric.so.1"
_BUNDLED = "lib/libfabric.so.1"
_MARKER = f".complete-{ONECCL_VERSION}"  # the name scripts/setup.sh has always checked
_LIBFABRIC_NOTE = ".libfabric"           # where the bundled libfabric came from


class InstallError(RuntimeError):
    """A step failed; the message says which and what to do."""


@dataclass
class Runtime:
    """What install_runtime put where, and what the check saw."""

    root: Path
    files: Dict[str, str] = field(default_factory=dict)  # relative path -> source project
    libfabric: str = ""                                   # "system <path>" or "bundled <path> (mpich ...)"
    verified: Dict[str, object] = field(default_factory=dict)

    @property
    def lib(self) -> Path:
        return self.root / "lib"


Say = Callable[[str], None]


def _default_say(msg: str) -> None:
    print(f"[install-runtime] {msg}", flush=True)


# ---- the steps ---------------------------------------------------------------
def _complete(root: Path) -> bool:
    return (root / _MARKER).is_file() and all((root / r).exists() for r in _REQUIRED)


def _pip_download(python: str, specs: Sequence[str], dest: Path) -> List[Path]:
    """``pip download --no-deps`` of exactly ``specs`` into ``dest``; the wheels."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), *specs]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError as e:
        raise InstallError(f"cannot run pip ({e}): install pip for {python}") from None
    if r.returncode != 0:
        err = "\n".join(ln for ln in r.stderr.splitlines() if "is ignored: it is neither" not in ln)
        raise InstallError(f"pip download failed ({' '.join(cmd)}):\n{err.strip()[-3000:]}")
    return sorted(dest.glob("*.whl"))


def _wheel_for(wheels: Sequence[Path], project: str) -> Path:
    """The downloaded wheel of ``project`` (wheel names use '_' for '-')."""
    stem = project.replace("-", "_") + "-"
    found = [w for w in wheels if w.name.startswith(stem)]
    if len(found) != 1:
        raise InstallError(f"expected one {project} wheel among {[w.name for w in wheels]}, found {len(found)}")
    return found[0]


def _umask() -> int:
    """This process's umask, read without changing it (``/proc``), else by
    setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _inside(dest: Path, rel: str) -> Optional[Path]:
    """``dest/rel`` where that stays inside ``dest`` (no absolute path, no
    ``..``, no link leading out), else None."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel:
        return None
    out = dest.joinpath(*parts)
    try:
        out.parent.resolve().relative_to(dest.resolve())
    except ValueError:
        return None
    return out


def _extract(wheel: Path, wanted: Sequence[str], dest: Path) -> List[str]:
    """Copy the ``<name>.data/data/<rel>`` members matching ``wanted`` into
    ``dest/<rel>``; the relative paths copied. A member whose path would
    leave ``dest`` fails the install (before anything is written); modes
    are 0666, or 0777 for an executable member, less the umask, as for any
    file this user creates (the wheel's own bits could make a file
    world-writable under ``~/.cache``)."""
    got: List[str] = []
    dest.mkdir(parents=True, exist_ok=True)
    umask = _umask()
    with zipfile.ZipFile(wheel) as z:
        todo = []
        for info in z.infolist():
            name = info.filename
            if ".data/data/" not in name or name.endswith("/"):
                continue
            rel = name.split(".data/data/", 1)[1]
            if not any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in wanted):
                continue
            out = _inside(dest, rel)
            if out is None:
                raise InstallError(f"{wheel.name}: member {name!r} would be written outside {dest}; "
                                   "the wheel is damaged or not the one expected")
            todo.append((info, rel, out))
        for info, rel, out in todo:
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g)
            executable = (info.external_attr >> 16) & 0o111
            os.chmod(out, (0o777 if executable else 0o666) & ~umask)
            got.append(rel)
    return got


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the two paths atomically (``renameat2(RENAME_EXCHANGE)``,
    Linux 3.15); False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _swap_in(new: Path, root: Path) -> None:
    """Replace ``root`` by ``new`` so that no reader sees half a runtime or
    none: the two are exchanged in one step where the system can (then the
    old runtime, now at ``new``, is deleted), else the old one is moved
    aside first and deleted after (under :func:`_locked`, as install_runtime
    does, no other install interleaves)."""
    if root.exists() and _exchange(new, root):
        shutil.rmtree(new, ignore_errors=True)
        return
    old = root.with_name(root.name + f".old-{os.getpid()}")
    if root.exists():
        root.rename(old)
    new.rename(root)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One install of ``root`` at a time (an ``flock`` on a file beside
    it): a second waits for the first, then finds the runtime complete."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _system_libfabric() -> str:
    """Path of the libfabric.so.1 the system loader gives (LD_LIBRARY_PATH,
    ldconfig), '' where none loads."""
    try:
        ctypes.CDLL("libfabric.so.1")
    except OSError:
        return ""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if "/libfabric.so" in path:
                return path
    return "libfabric.so.1"


def _assemble(root: Path, python: str, say: Say) -> Dict[str, str]:
    """Download the three wheels and build the working set into ``root``."""
    root.parent.mkdir(parents=True, exist_ok=True)
    specs = [f"{p}=={ONECCL_VERSION}" for p, _ in _PARTS]
    with tempfile.TemporaryDirectory(prefix="streamcoll-wheels-", dir=str(root.parent)) as tmp:
        say(f"downloading {', '.join(specs)} (pip download --no-deps)")
        wheels = _pip_download(python, specs, Path(tmp) / "w")
        new = Path(tmp) / "oneccl"
        files: Dict[str, str] = {}
        for project, wanted in _PARTS:
            wheel = _wheel_for(wheels, project)
            got = _extract(wheel, wanted, new)
            say(f"took {', '.join(sorted(set(g if not g.startswith('include/') else 'include/' for g in got)))}"
                f" from {wheel.name}")
            files.update({g: project for g in got})
        missing = [r for r in _REQUIRED if not (new / r).exists()]
        if missing:
            raise InstallError(f"the oneCCL {ONECCL_VERSION} wheels lack {missing}")
        (new / _MARKER).write_text("ok\n")
        _swap_in(new, root)
    return files


def _bundle_libfabric(root: Path, python: str, say: Say) -> str:
    """Put the mpich wheel's libfabric.so.1 beside libccl.so.1."""
    with tempfile.TemporaryDirectory(prefix="streamcoll-wheels-", dir=str(root.parent)) as tmp:
        spec = f"mpich=={MPICH_VERSION}"
        say(f"downloading {spec} for its libfabric.so.1 (pip download --no-deps)")
        wheel = _wheel_for(_pip_download(python, [spec], Path(tmp) / "w"), "mpich")
        got = _extract(wheel, [_MPICH_LIBFABRIC], Path(tmp) / "x")
        if not got:
            raise InstallError(f"{wheel.name} has no {_MPICH_LIBFABRIC}")
        part = root / (_BUNDLED + ".part")
        shutil.copy2(Path(tmp) / "x" / _MPICH_LIBFABRIC, part)
        part.rename(root / _BUNDLED)
    (root / _LIBFABRIC_NOTE).write_text(f"mpich {MPICH_VERSION}\n")
    return f"bundled {root / _BUNDLED} (from the mpich {MPICH_VERSION} wheel)"


def _libfabric(root: Path, mode: str, python: str, say: Say) -> str:
    """Settle which libfabric oneCCL will load; a description of it."""
    bundled = root / _BUNDLED
    if mode == "system":
        if bundled.exists():
            bundled.unlink()
            (root / _LIBFABRIC_NOTE).unlink(missing_ok=True)
            say(f"removed the bundled {bundled} (--libfabric system)")
        found = _system_libfabric()
        if not found:
            raise InstallError(f"no system libfabric.so.1 (oneCCL's transport): {APT_COMMAND}   "
                               "(or run install-runtime with --libfabric pip for the mpich wheel's copy)")
        return f"system {found}"
    if bundled.exists():
        src = (root / _LIBFABRIC_NOTE).read_text().strip() if (root / _LIBFABRIC_NOTE).exists() else "?"
        return f"bundled {bundled} (from the {src} wheel, kept)"
    if mode == "auto":
        found = _system_libfabric()
        if found:
            return f"system {found}"
        say("no system libfabric.so.1: taking the one the mpich wheel bundles (no root needed)")
    try:
        return _bundle_libfabric(root, python, say)
    except InstallError as e:
        raise InstallError(f"{e}\nno libfabric.so.1 for oneCCL's transport; install the system one: {APT_COMMAND}") from None


_VERIFY = r"""
import json, os, sys
import torch, streamcoll
from streamcoll._ffi.oneccl import ONECCL
comm = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                   store=torch.distributed.HashStore())
t = torch.full((8,), 2.0)
comm.all_reduce(t)
comm.destroy()
maps = open("/proc/self/maps").read().split("\n")
fabric = sorted({ln.split(maxsplit=5)[-1] for ln in maps if "/libfabric.so" in ln})
print("@@verify@@" + json.dumps({"path": ONECCL.path, "tried": ONECCL.tried, "version": ONECCL.version_string(),
                                 "sum": t.tolist(), "libfabric": fabric}))
"""


def _verify(root: Path, python: str, timeout: float = 300.0) -> Dict[str, object]:
    """Load ``root/lib`` in a fresh interpreter and all-reduce on a one-rank
    communicator; what it saw. Raises InstallError with its output."""
    pkg_parent = str(Path(__file__).resolve().parents[2])  # the folder holding the package
    env = dict(os.environ)
    env["STREAMCOLL_ONECCL_LIBRARY"] = str(root / "lib")
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("CCL_KVS_IFACE", "lo")
    try:
        r = subprocess.run([python, "-c", _VERIFY], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InstallError(f"the check (a one-rank communicator on {root / 'lib'}) did not finish in {timeout:.0f} s") from None
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@verify@@")), None)
    if r.returncode != 0 or line is None:
        raise InstallError(f"the check (a one-rank communicator on {root / 'lib'}) failed (exit {r.returncode}):\n"
                           f"{(r.stdout + r.stderr).strip()[-4000:]}")
    seen = json.loads(line[len("@@verify@@"):])
    want = os.path.realpath(root / "lib" / "libccl.so.2")
    if seen["path"] != want or seen["sum"] != [2.0] * 8:
        raise InstallError(f"the check loaded {seen['path']} (wanted {want}) and summed {seen['sum']}; "
                           "places tried:\n  " + "\n  ".join(seen["tried"]))
    return seen


def install_runtime(home: Optional[os.PathLike] = None, libfabric: str = "auto", force: bool = False,
                    python: Optional[str] = None, say: Say = _default_say) -> Runtime:
    """Assemble (unless already complete, or ``force``), settle libfabric,
    and verify the oneCCL CPU runtime in ``<home>/oneccl``; what is where.

    ``home`` defaults to ``$STREAMCOLL_HOME`` (``~/.cache/streamcoll``);
    ``python`` is the interpreter whose pip downloads and which runs the
    check (default: this one)."""
    if libfabric not in LIBFABRIC_MODES:
        raise ValueError(f"libfabric must be one of {LIBFABRIC_MODES}, got {libfabric!r}")
    python = python or sys.executable
    root = (Path(home) if home is not None else runtime_home()).expanduser().absolute() / "oneccl"
    rt = Runtime(root)
    say(f"1/4 oneCCL {ONECCL_VERSION} CPU runtime in {root}")
    with _locked(root):  # a second install at once waits here, then finds it complete
        if _complete(root) and not force:
            say("2/4 already assembled: nothing to download (--force rebuilds it)")
            rt.files = {r: "" for r in _REQUIRED}
        else:
            say("2/4 assembling the working set from three wheels")
            rt.files = _assemble(root, python, say)
        say(f"3/4 libfabric ({libfabric})")
        rt.libfabric = _libfabric(root, libfabric, python, say)
    say(f"    libfabric: {rt.libfabric}")
    say("4/4 checking it: a fresh interpreter loads it and all-reduces on a one-rank communicator")
    rt.verified = _verify(root, python)
    say(f"    ok: oneCCL {rt.verified['version']} from {rt.verified['path']}, libfabric "
        f"{', '.join(rt.verified['libfabric']) or '(not mapped)'}")  # type: ignore[arg-type]
    return rt


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m streamcoll install-runtime") -> int:
    """The command line; the exit code (0: installed and verified)."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, shared by this module's ``main`` and ``python -m streamcoll``."""
    p.add_argument("--home", default=None,
                   help="where to put oneccl/ (default: $STREAMCOLL_HOME, else ~/.cache/streamcoll)")
    p.add_argument("--libfabric", choices=LIBFABRIC_MODES, default="auto",
                   help="auto: the system's if one loads, else the mpich wheel's; system; pip (always the wheel's)")
    p.add_argument("--force", action="store_true", help="download and assemble again even if complete")


def run(args: argparse.Namespace) -> int:
    """Install with the parsed options, print the summary line; the exit code."""
    try:
        rt = install_runtime(args.home, libfabric=args.libfabric, force=args.force)
    except InstallError as e:
        _default_say(f"FAILED: {e}")
        return 1
    _default_say(
        f"done: oneCCL {ONECCL_VERSION} CPU runtime in {rt.root}: lib/libccl.so.1 (oneccl-cpu), "
        f"lib/libccl.so.2 + lib/libccl_legacy_cpu.so (oneccl), include/oneapi (oneccl-cpu-devel); "
        f"libfabric {rt.libfabric}; check it with: {_check_command(rt.root)}")
    return 0


def _check_command(root: Path) -> str:
    """``python -m streamcoll info``, with the variable that makes the loader
    look in ``root`` when it is not the default place."""
    if root == runtime_home().expanduser().absolute() / "oneccl":
        return "python -m streamcoll info"
    return f"STREAMCOLL_HOME={root.parent} python -m streamcoll info"


if __name__ == "__main__":
    sys.exit(main())
