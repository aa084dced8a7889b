"""A pipeline's step time from what its stages measured (profiling on a shared CPU box).

Profiling there measures each rank's thread CPU time (``PhaseTimer``
``clock="cpu"``), which leaves out the time a stage waits for its neighbour:
the pipeline bubble. ``pipeline_makespan`` puts it back from the measured
per-micro-batch busy times, not from a formula; ``replayed_ms`` gathers them
from every stage (``Parallel.time_chunks`` records them).
"""

from __future__ import annotations

from typing import Any


def pipeline_makespan(F: list[list[float]], Bk: list[list[float]], tail: list[float]) -> float:
    """Length of one GPipe step from each stage's measured busy times:
    ``F[s][k]``/``Bk[s][k]`` forward/backward of micro-batch k on stage s,
    ``tail[s]`` what stage s does after its last backward (optimizer step).
    Replays the schedule's dependencies (forward k on stage s after forward k
    on s-1 and forward k-1 on s; a stage's backwards after its forwards, in
    order, backward k after backward k on s+1), i.e. the step's critical path
    as it is when every stage has its own processor."""
    pp, m = len(F), len(F[0])
    fend = [[0.0] * m for _ in range(pp)]
    for s in range(pp):
        for k in range(m):
            fend[s][k] = max(fend[s - 1][k] if s else 0.0, fend[s][k - 1] if k else 0.0) + F[s][k]
    bend = [[0.0] * m for _ in range(pp)]
    for s in reversed(range(pp)):
        for k in range(m):
            prev = bend[s][k - 1] if k else fend[s][m - 1]
            bend[s][k] = max(prev, bend[s + 1][k] if s < pp - 1 else 0.0) + Bk[s][k]
    return max(bend[s][m - 1] + tail[s] for s in range(pp))


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def replayed_ms(dist: Any, traces: list[dict], stage_ranks: list[int], q: float) -> float:
    """The pipeline's step time (ms, ``q``-quantile over the measured steps) from
    every stage's traces (``{"f": [...], "b": [...], "tail": s}`` per step).
    Collective: every rank takes part; ``stage_ranks[s]`` is a rank of stage s."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, traces)
    stages = [every[r] for r in stage_ranks]
    spans = [pipeline_makespan([st[i]["f"] for st in stages], [st[i]["b"] for st in stages],
                               [st[i]["tail"] for st in stages]) for i in range(len(traces))]
    return quantile(spans, q) * 1e3
