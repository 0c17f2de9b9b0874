"""Bandwidth definitions and timing statistics shared by the benchmarks.

algbw and busbw are nccl-tests' definitions (NVIDIA/nccl-tests,
``doc/PERFORMANCE.md``, "Performance reported by NCCL tests"):

- ``algbw = S / t``: S is the message size in bytes, t the time of one
  operation. GB/s means 1e9 bytes per second, as nccl-tests prints it.
- ``busbw = algbw * factor``, the factor making the figure comparable with the
  hardware's peak bandwidth whatever the rank count n:
  all_reduce ``2(n-1)/n``; reduce_scatter, all_gather, all_to_all ``(n-1)/n``;
  broadcast, reduce, send/recv ``1``.
- For all_gather and reduce_scatter, S is the size of the full array
  (``count * element size * n``), not one rank's contribution; for
  all_to_all it is one rank's whole send buffer.

So busbw is the figure to compare across collectives and rank counts, and the
one the issue's bandwidth targets are stated in.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, Optional, Sequence

from ..core import spec

__all__ = ["BUS_FACTOR", "bus_factor", "algbw", "busbw", "Stats", "summarise", "fmt_bytes", "ratio"]

# collective -> busbw factor as a function of the rank count n (PERFORMANCE.md),
# declared with each collective in streamcoll.core.spec; the benchmarks' send/recv pair is 1.
BUS_FACTOR: Dict[str, Callable[[int], float]] = {
    **{name: s.bus_factor for name, s in spec.TABLE.items() if s.bus_factor is not None},
    "sendrecv": lambda n: 1.0,
}


def bus_factor(collective: str, n: int) -> float:
    try:
        return BUS_FACTOR[collective](n)
    except KeyError:
        raise ValueError(f"collective: no busbw factor for {collective!r} (known: {', '.join(BUS_FACTOR)})") from None


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def busbw(collective: str, nbytes: int, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw times the collective's factor."""
    return algbw(nbytes, seconds) * bus_factor(collective, n)


class Stats:
    """min/median/max of per-call times (seconds) from several repetitions.

    ``spread`` is max/min; a run is *noisy* when it exceeds the threshold
    (other processes on a 2-core machine show up as a few slow repetitions).
    """

    __slots__ = ("min", "median", "max", "samples", "threshold")

    def __init__(self, samples: Sequence[float], threshold: float = 1.5) -> None:
        if not samples:
            raise ValueError("samples: expected at least one timing")
        s = sorted(float(x) for x in samples)
        self.samples = s
        self.min = s[0]
        self.median = statistics.median(s)
        self.max = s[-1]
        self.threshold = threshold

    @property
    def spread(self) -> float:
        return self.max / self.min if self.min > 0 else float("inf")

    @property
    def noisy(self) -> bool:
        return len(self.samples) > 1 and self.spread > self.threshold

    def as_us(self) -> Dict[str, float]:
        return {"min": self.min * 1e6, "median": self.median * 1e6, "max": self.max * 1e6}


def summarise(collective: str, nbytes: int, n: int, samples: Sequence[float],
              threshold: float = 1.5) -> Dict[str, object]:
    """The JSON record of one library's timings for one row: times in us
    (min/median/max), algbw and busbw in GB/s from the median, spread."""
    st = Stats(samples, threshold)
    return {
        "time_us": st.as_us(),
        "algbw": algbw(nbytes, st.median),
        "busbw": busbw(collective, nbytes, st.median, n),
        "spread": st.spread,
        "noisy": st.noisy,
        "samples": len(st.samples),
    }


def fmt_bytes(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b
