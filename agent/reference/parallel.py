"""Process layout of a plan and the collectives the reference workload uses.

Ranks are laid out Megatron-style: TP fastest, then DP, then PP, so a TP
group is a run of consecutive ranks (on one node when the placement gives the
node a multiple of ``tp`` ranks, which ``perfmodel.plans`` requires) and the
pipeline stages are the slowest-varying coordinate::

    rank = (stage * dp + dp_rank) * tp + tp_rank

Every rank creates every group in the same order (``torch.distributed``
requires it). The same code runs on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    rank: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def stage(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def peer(self, stage_delta: int) -> int:
        """The same (dp, tp) position in the neighbouring pipeline stage."""
        return self.rank_of(self.stage + stage_delta, self.dp_rank, self.tp_rank)

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(s, d, t) for t in range(self.tp)] for s in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(s, d, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]


class Comm:
    """The job's process groups and the few collectives it needs, with the
    group sizes of 1 short-circuited (no communication at all)."""

    def __init__(self, dist: Any, layout: Layout):
        self.dist = dist
        self.layout = layout
        self.tp_group = self.dp_group = None
        for ranks in layout.tp_groups():  # every rank creates every group, in order
            g = dist.new_group(ranks) if layout.tp > 1 else None
            if layout.rank in ranks:
                self.tp_group = g
        for ranks in layout.dp_groups():
            g = dist.new_group(ranks) if layout.dp > 1 else None
            if layout.rank in ranks:
                self.dp_group = g
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    # data parallel
    def dp_all_reduce(self, t) -> None:
        if self.layout.dp > 1:
            self.dist.all_reduce(t, group=self.dp_group)

    def dp_reduce_scatter(self, out, full) -> None:
        if self.layout.dp > 1:
            self._scatter(out, full, group=self.dp_group)
        else:
            out.copy_(full)

    def dp_all_gather(self, full, shard) -> None:
        if self.layout.dp > 1:
            self._gather(full, shard, group=self.dp_group)
        else:
            full.copy_(shard)

    # tensor parallel
    def tp_all_reduce(self, t) -> None:
        if self.layout.tp > 1:
            self.dist.all_reduce(t, group=self.tp_group)

    # pipeline
    def send(self, t, stage_delta: int) -> None:
        self.dist.send(t.contiguous(), dst=self.layout.peer(stage_delta))

    def recv(self, t, stage_delta: int):
        self.dist.recv(t, src=self.layout.peer(stage_delta))
        return t


def tp_ops(torch: Any, comm: Comm):
    """Megatron's two conjugate operators for a TP group:
    ``copy`` (f): identity forward, all-reduce of the gradient backward, in
    front of a column-parallel layer; ``reduce`` (g): all-reduce forward,
    identity backward, behind a row-parallel layer."""

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            comm.tp_all_reduce(g)
            return g

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            comm.tp_all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    return Copy.apply, Reduce.apply
