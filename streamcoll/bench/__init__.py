"""Benchmarks: nccl-tests-style sweeps and per-call overhead, each side by
side with torch.distributed measured in the same run.

- ``python -m streamcoll.bench`` (under torchrun): the sweep over message
  sizes and collectives, see :mod:`streamcoll.bench.sweep`.
- ``python -m streamcoll.bench.overhead``: host cost of one call at world
  size 1, see :mod:`streamcoll.bench.overhead`.

Timings are reported, never asserted: a benchmark checks correctness of what
it timed and warns when the machine was noisy.
"""
