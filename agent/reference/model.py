"""The reference model: a residual MLP classifier (``inp`` -> blocks -> ``out``),
each block ``x + down(gelu(up(norm(x))))``, a plain ``nn.Module``.

The plan library applies the plan (``train.py``): TP splits ``up`` by
columns and ``down`` by rows (``train.TP_PLAN``), PP splits ``blocks`` into
contiguous stages (``inp`` on the first, ``out`` on the last), GC wraps each
block. Parameter names are those of the whole model under every plan
(``blocks.<i>.up.weight``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int, classes: int):
        super().__init__()
        # created in this order (inp, each block's norm/up/down, out): the seeded initial model
        self.inp = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):  # what a plan without PP runs
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def set_dtype(args: Any) -> None:
    """The default dtype for the whole run (the data set is drawn in it too)."""
    torch.set_default_dtype(getattr(torch, args.dtype))


def build(args: Any) -> Net:
    """The same initial model on every rank and under every plan (seeded)."""
    set_dtype(args)
    torch.manual_seed(args.seed)
    return Net(args.dim, args.hidden, args.layers, args.classes)


def dataset(args: Any):
    from gearshift.agent.reference.data import dataset as draw

    set_dtype(args)
    return draw(args, torch)


def step_noise(args: Any, step: int, B: int):
    """The input noise of ``step`` for the whole global batch (the same under every plan)."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    return args.noise * torch.randn(B, args.dim, generator=g)


def loss_fn(logits, target):
    return F.cross_entropy(logits, target)
