"""Communicator creation's store part at 64..4096 simulated ranks, against
torch's own pattern in the same run: see :mod:`streamcoll.bench.rendezvous`.

    PYTHONPATH=. python benchmarks/rendezvous.py                      # 64, 256, 1024, 4096 ranks, 8 processes
    PYTHONPATH=. python benchmarks/rendezvous.py --ranks 1024 --procs 4
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamcoll.bench.rendezvous import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
