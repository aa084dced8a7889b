"""The reference workload's data: a fixed synthetic classification task, read
as a stream defined by the global sample index, independent of the plan.

Step ``s`` (0-based) reads samples ``perm_e[o:o+B]`` of the epoch-``e``
permutation (``s*B = e*n + o``), seeded by (seed, epoch); DP rank ``d`` takes
the ``d``-th of ``dp`` contiguous slices and splits it into ``ga``
micro-batches. The input noise of step ``s`` is drawn from a generator seeded
by (seed, s) for the whole global batch, so it too is the same under every
plan and after any restart: the data position is just the step.
"""

from __future__ import annotations

import math
from typing import Any


def dataset(args: Any, torch: Any):
    """Inputs and a random teacher's labels."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset, args.dim, generator=g)
    w1 = torch.randn(args.dim, 128, generator=g) / math.sqrt(args.dim)
    w2 = torch.randn(128, args.classes, generator=g) / math.sqrt(128)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


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


def micro_batches(step: int, X, Y, args: Any, torch: Any, cache: dict, *, B: int, dp: int, dp_rank: int,
                  ga: int, mb: int) -> tuple[list, list]:
    """This DP rank's ``ga`` micro-batches (inputs with the step's noise, labels) of ``step``."""
    idx = step_indices(step, B, args.dataset, args.seed, torch, cache)
    noise = torch.randn(B, args.dim, generator=torch.Generator().manual_seed(args.seed * 100003 + step))
    per = B // dp
    xs, ys = [], []
    for k in range(ga):
        a = dp_rank * per + k * mb
        part = idx[a:a + mb]
        xs.append(X[part] + args.noise * noise[a:a + mb].to(X.device, X.dtype))
        ys.append(Y[part])
    return xs, ys
