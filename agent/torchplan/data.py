"""The data stream every plan reads: a function of the global sample index.

Step ``s`` (0-based) reads samples ``perm_e[o:o+B]`` of the epoch-``e``
permutation (``s*B = e*n + o``), seeded by (seed, epoch); DP rank ``d`` takes
the ``d``-th of ``dp`` contiguous slices and splits it into ``ga``
micro-batches (``job.Job.micro_batches``). The data position is just the step.
"""

from __future__ import annotations

from typing import Any


def step_indices(step: int, B: int, n: int, seed: int, torch: Any, cache: dict):
    """The B sample indices of ``step`` (0-based), the same under every plan."""
    start = step * B
    epoch, off = divmod(start, n)
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    perm = cache[epoch]
    if off + B > n:
        raise ValueError("global batch must divide the data set size")
    return perm[off: off + B]
