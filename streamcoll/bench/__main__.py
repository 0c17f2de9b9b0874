"""``python -m streamcoll.bench``: the sweep (see :mod:`streamcoll.bench.sweep`)."""
import sys

from .sweep import main

sys.exit(main())
