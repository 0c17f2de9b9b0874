"""``python -m streamcoll info``: what streamcoll finds on this machine.
(``python -m streamcoll install-runtime``: see streamcoll/startup/install.py.)

For each native library: the file it loaded, its version, and every place
looked, in search order, with why each was passed over (missing, not
loadable, or rejected by the binding's check that it works) and the places
after the one taken (or, where nothing loads, the error a collective would
raise, with the install command). Then
the environment variables that steer streamcoll, NCCL and oneCCL, and the
defaults streamcoll would apply when it creates a communicator (only for
variables not already set). Always exits 0: it is the command to run when
something does not load.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import List, Optional, TextIO, Tuple


def _library_report(binding, out: TextIO) -> None:
    from ._ffi.errors import LibraryNotFoundError

    w = out.write
    w(f"{binding.name}:\n")
    w(f"  declarations: streamcoll/_native/{binding.declarations}.h ({binding.name} {binding.declared_version})\n")
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
    for line in declarations_report(binding):
        w(f"  {line}\n")
    w("  looked, in order:\n")
    for i, t in enumerate(binding.tried, 1):
        w(f"    {i}. {t}\n")
    rest = _not_reached(binding)
    if rest:
        w("  not reached (after the one loaded):\n")
        for desc, path in rest:
            w(f"    - {desc}: {path or 'not set'}\n")


def _release(s: str) -> Tuple[int, ...]:
    """``"2.32.3"`` -> ``(2, 32, 3)`` (a part that is not a number ends it)."""
    out = []
    for part in s.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def declarations_report(binding) -> List[str]:
    """Which loaded release against which declarations (torch's
    CUDA builds bring their own NCCL, e.g. 2.20.5 with torch 2.4 and 2.28.9
    with torch 2.11, older than the declarations), and a WARNING naming
    every declared function the loaded library does not export: calling one
    raises FunctionNotFoundError (it never fails at import). Always a
    release line; never raises."""
    declared = binding.declared_version
    try:
        loaded = "%d.%d.%d" % binding.split_version(binding.version())
    except Exception as e:
        return [f"against: declarations of {binding.name} {declared}; the loaded release is unknown "
                f"({type(e).__name__}: {e})"]
    n = len(_release(declared))
    have, want = _release(loaded)[:n], _release(declared)
    how = ("the same release" if have == want else
           "older than the declarations" if have < want else
           "newer than the declarations (what it adds is not declared, so not used)")
    lines = [f"against: {binding.name} {loaded} loaded, declarations of {declared} "
             f"(streamcoll/_native/{binding.declarations}.h): {how}"]
    raw = binding._raw
    missing = []
    for name in dir(raw):  # the declared functions and constants
        try:
            getattr(raw, name)
        except AttributeError:  # a constant always resolves: a function the library lacks
            missing.append(name)
        except Exception:
            continue
    if missing:
        need = binding.min_versions
        listed = ", ".join(f"{m} ({need[m]})" if m in need else m for m in sorted(missing))
        # Older than the declarations: what the declarations assume is not
        # there. Otherwise a function the header declares but this build
        # does not export (oneCCL 2022.2 marks two "not implemented").
        head = "WARNING" if have < want else "note"
        lines.append(f"{head}: {binding.name} {loaded} lacks {len(missing)} declared function(s); "
                     f"calling one raises FunctionNotFoundError (release that has it in brackets): {listed}")
    elif have < want:
        lines.append(f"note: every declared function is exported; structs and enums follow "
                     f"{declared}'s layout (NCCL's ncclConfig_t is prefix-compatible, copied by its size)")
    return lines


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


def _would_apply(hosts: int = 1, local_size: int = 1, cpus: Optional[tuple] = None) -> dict:
    """The defaults a communicator would get here now, for ``hosts`` hosts
    of ``local_size`` ranks (this rank the first; ``cpus``: each rank's CPU
    set, default this process's), computed by env's pure functions from
    made-up facts of such ranks: nothing is set."""
    from .startup import env_defaults as env, topology

    me = topology.local_facts(0)  # a fresh process's: only the user's values are bound
    me = dataclasses.replace(me, bound=tuple(b for b in me.bound if b[2] == env.USER))
    cpus = tuple(me.cpus) if cpus is None else cpus
    def made_up(r: int) -> "topology.RankFacts":
        h = r // local_size  # host 0 is this machine; the others are machines of their own
        if hosts == 1:
            return dataclasses.replace(me, rank=r, pid=me.pid + r, cpus=cpus)
        return dataclasses.replace(me, rank=r, pid=me.pid + r, cpus=cpus, identity=f"{me.identity} host={h}",
                                   machine=me.machine if h == 0 else f"{me.machine} host={h}",
                                   hostname=f"{me.hostname}-{h}")

    facts = [made_up(r) for r in range(hosts * local_size)]
    topo = topology.Topology.from_facts(facts, 0)
    out = env.plan(topo, "oneccl", running={})
    out.update(env.plan(topo, "nccl", running={}))
    return out


def info(out: Optional[TextIO] = None) -> int:
    """Print the report to ``out`` (default: stdout); returns the exit code (0)."""
    import cffi

    out = out if out is not None else sys.stdout

    from . import __version__
    from .startup import env_defaults as env

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
    for name in ("oneccl", "nccl", "cudart"):
        try:
            binding = importlib.import_module(f"streamcoll._ffi.{name}").binding
        except Exception as e:  # declarations missing or unparsable: report, exit 0
            w(f"{name}:\n  status: ERROR (the binding does not import) {type(e).__name__}: {e}\n\n")
            continue
        _library_report(binding, out)
        w("\n")

    _launcher_report(out)
    from .core.env_vars import TABLE
    w("environment (streamcoll/core/env_vars.py says what each does):\n")
    for var in TABLE:
        val = os.environ.get(var.name)
        w(f"  {var.name}={val}\n" if val is not None else f"  {var.name} (not set) [{var.kind}, default "
          f"{var.default or 'none'}]\n")
    w("\n")
    if env.APPLIED:
        w("defaults streamcoll applied in this process (around its native calls only; not inherited):\n")
        w("".join(f"  {k}={v}\n" for k, v in env.APPLIED.items()))
    would = _would_apply()
    if not env._enabled():
        w("defaults: off (STREAMCOLL_NO_ENV_DEFAULTS is set)\n")
    elif would:
        w("defaults streamcoll applies when it creates a communicator with every rank on this host\n"
          "(only variables not set above; see streamcoll/startup/env_defaults.py for why each):\n")
        w("".join(f"  {k}={v}\n" for k, v in would.items()))
    else:
        w("defaults: none to apply (every variable they cover is set)\n")
    if env._enabled():
        _several_hosts_report(out)
    return 0


def _launcher_report(out: TextIO) -> None:
    """The launcher streamcoll detects (streamcoll/startup/launchers.py), with what
    it says; the rendezvous is found when a communicator is made."""
    from .startup import launchers

    w = out.write
    try:
        launch = launchers.current()
    except ValueError as e:  # a malformed launcher variable: report, exit 0
        w(f"launcher: ERROR {e}\n\n")
        return
    if launch is None:
        w("launcher: none detected (a plain process: rank 0 of 1 unless RANK/WORLD_SIZE are set)\n\n")
        return
    w(f"launcher: {launch.launcher}\n  {launch.describe()}\n")
    la = next(la for la in launchers.TABLE if la.name == launch.launcher)
    w(f"  rendezvous: {_rendezvous_way(la.rendezvous)}\n\n")


def _rendezvous_way(kind: str) -> str:
    return {"env": "MASTER_ADDR/MASTER_PORT (as torchrun)",
            "slurm": "MASTER_ADDR/MASTER_PORT where set, else the first host of the step's nodelist and a port "
                     "from the job and step id",
            "mpi": "MASTER_ADDR/MASTER_PORT where set, else mpi4py (rank 0 broadcasts its address and a free "
                   "port)"}[kind]


def _several_hosts_report(out: TextIO) -> None:
    """What a communicator spanning several hosts would apply on this host,
    with the interface that reaches the rendezvous address now."""
    from .startup import env_defaults as env, topology

    w = out.write
    addr = topology.rendezvous_address()
    route = topology.route_to(addr) if addr else None
    ident, _, _ = topology.host_identity()
    w(f"\nhost identity (ranks with the same one share a host): {ident}\n")
    if route is None:
        w("route to the rendezvous: MASTER_ADDR not set (no interface defaults on several hosts)\n")
    else:
        w(f"route to the rendezvous: {route.describe()}\n")
    cores = topology._cpus()
    cases: List[Tuple[str, int, Optional[Tuple[int, ...]]]] = [
        (f"2 hosts x {local} rank(s), a core each", local, None) for local in (1, 2)]
    cases.append(("2 hosts x 2 ranks, more ranks on this machine than cores", 2, cores[:1]))
    for what, local, cpus in cases:
        would = _would_apply(2, local, cpus)
        w(f"defaults on several hosts, e.g. {what} (only variables not set above):\n")
        w("".join(f"  {k}={v}\n" for k, v in would.items()) or "  none\n")
    w("  (hosts that share a hostname get no CCL_ATL_SHM: oneCCL groups shm peers by hostname)\n")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamcoll",
        description="info: what streamcoll finds on this machine (the default); "
                    "install-runtime: the oneCCL CPU runtime into streamcoll's cache.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="libraries found, versions, places looked, environment")
    from .startup import install
    install.add_arguments(sub.add_parser(
        "install-runtime", help=f"assemble the oneCCL {install.ONECCL_VERSION} CPU runtime into the cache and check it",
        description=install.DESCRIPTION))
    args = parser.parse_args(argv)
    if args.command in (None, "info"):
        return info()
    if args.command == "install-runtime":
        return install.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
