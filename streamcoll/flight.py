"""The command ``python -m streamcoll.flight analyze DIR`` (documented in the
README): reads the flight dumps of every rank and names where they diverge.
The code lives in :mod:`streamcoll.diagnostics.flight`; this module is the
command's public name, kept in the package's face, with the analysis's
public functions (``analyze``, ``load_dumps``, ``Finding``)."""
import sys

from .diagnostics.flight import Finding, analyze, load_dumps, main

__all__ = ["analyze", "load_dumps", "Finding", "main"]

if __name__ == "__main__":
    sys.exit(main())
