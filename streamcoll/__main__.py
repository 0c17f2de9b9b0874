"""``python -m streamcoll info``: what streamcoll finds on this machine.

For each native library: the file it loaded, its version, and every place
looked, in search order, with why each was passed over (or, where nothing
loads, the error a collective would raise, with the install command). Then
the environment variables that steer streamcoll, NCCL and oneCCL, and the
defaults streamcoll would apply when it creates a communicator (only for
variables not already set). Always exits 0: it is the command to run when
something does not load.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, TextIO


def _library_report(binding, out: TextIO) -> None:
    from .errors import LibraryNotFoundError

    w = out.write
    w(f"{binding.name}:\n")
    w(f"  declarations: native/{binding.declarations}.h ({binding.name} {binding.declared_version})\n")
    try:
        binding.lib()
    except LibraryNotFoundError as e:
        w("  status: NOT FOUND\n")
        w("".join(f"    {line}\n" for line in str(e).splitlines()))
        return
    except Exception as e:  # a broken library: report, never crash
        w(f"  status: ERROR {type(e).__name__}: {e}\n")
        return
    w("  status: loaded\n")
    w(f"  path: {binding.path}\n")
    try:
        w(f"  version: {binding.version_string()} ({binding.version()})\n")
    except Exception as e:
        w(f"  version: unknown ({type(e).__name__}: {e})\n")
    w("  looked, in order:\n")
    for i, t in enumerate(binding.tried, 1):
        w(f"    {i}. {t}\n")
    rest = _not_reached(binding)
    if rest:
        w("  not reached (after the one loaded):\n")
        for desc, path in rest:
            w(f"    - {desc}: {path or 'not set'}\n")


def _not_reached(binding) -> List[tuple]:
    """Candidates after the one that loaded, as the search order stands now."""
    try:
        cands = binding.candidates()
    except Exception:
        return []
    seen = [t.split(":", 1)[0] for t in binding.tried]
    last = seen[-1] if seen else None
    out, after = [], False
    for desc, path in cands:
        if after:
            out.append((desc, path))
        elif desc == last and path and binding.tried[-1].startswith(f"{desc}: {path}"):
            after = True
    return out


def _would_apply() -> dict:
    """The defaults env.apply_*_defaults would set for a single-host
    communicator now, computed on a copy of the environment and undone."""
    from . import env

    saved_env, saved_applied = dict(os.environ), dict(env.APPLIED)
    try:
        env.APPLIED.clear()
        env.apply_oneccl_defaults(True, 0, 1)
        env.apply_nccl_defaults(True)
        return dict(env.APPLIED)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        env.APPLIED.clear()
        env.APPLIED.update(saved_applied)


def info(out: Optional[TextIO] = None) -> int:
    """Print the report to ``out`` (default: stdout); returns the exit code (0)."""
    import cffi

    out = out if out is not None else sys.stdout

    from . import __version__, env
    from ._ffi.nccl import NCCL
    from ._ffi.oneccl import ONECCL

    w = out.write
    here = os.path.dirname(os.path.abspath(__file__))
    w(f"streamcoll {__version__} ({here})\n")
    versions = [f"python {sys.version.split()[0]}", f"cffi {cffi.__version__}"]
    try:
        import torch
        versions.append(f"torch {torch.__version__}")
    except Exception as e:  # pragma: no cover - torch is a dependency
        versions.append(f"torch: {type(e).__name__}: {e}")
    w("  " + ", ".join(versions) + "\n\n")
    for binding in (ONECCL, NCCL):
        _library_report(binding, out)
        w("\n")

    from .env_vars import TABLE
    w("environment (streamcoll/env_vars.py says what each does):\n")
    for var in TABLE:
        val = os.environ.get(var.name)
        w(f"  {var.name}={val}\n" if val is not None else f"  {var.name} (not set) [{var.kind}, default "
          f"{var.default or 'none'}]\n")
    w("\n")
    if env.APPLIED:
        w("defaults streamcoll applied in this process:\n")
        w("".join(f"  {k}={v}\n" for k, v in env.APPLIED.items()))
    would = _would_apply()
    if not env._enabled():
        w("defaults: off (STREAMCOLL_NO_ENV_DEFAULTS is set)\n")
    elif would:
        w("defaults streamcoll applies when it creates a communicator with every rank on this host\n"
          "(only variables not set above; see streamcoll/env.py for why each):\n")
        w("".join(f"  {k}={v}\n" for k, v in would.items()))
        w("  (several hosts: only CCL_LOCAL_RANK, CCL_LOCAL_SIZE, CCL_LOG_LEVEL)\n")
    else:
        w("defaults: none to apply (every variable they cover is set)\n")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamcoll", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="libraries found, versions, places looked, environment")
    args = parser.parse_args(argv)
    if args.command in (None, "info"):
        return info()
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
