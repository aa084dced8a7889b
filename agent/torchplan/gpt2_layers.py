"""GPT-2's blocks in layers a tensor-parallel plan can split.

transformers' GPT-2 computes its projections with ``Conv1D`` (a linear layer
whose weight is stored in x out), which DTensor's ``ColwiseParallel`` and
``RowwiseParallel`` do not split, and its attention projects q, k and v with
one fused ``c_attn`` whose output a column split would cut across q/k/v.
``linearize`` replaces, in every block, each ``Conv1D`` by the ``nn.Linear`` of
the same function (weight transposed, no new random draw) and ``c_attn`` by
``FusedQKV``: three of them (``q``, ``k``, ``v``) whose outputs are concatenated.
The block computes what it did, and a column split of ``q``, ``k`` and ``v``
gives each rank its heads of all three (``families.GPT2.after_tp`` then tells
the attention its split size and head count). It is applied under every plan,
so a checkpoint's parameter names do not depend on the plan.
"""

from __future__ import annotations

import torch
from torch import nn


def as_linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """The ``nn.Linear`` computing ``x @ weight + bias`` (a ``Conv1D``'s function)."""
    lin = nn.utils.skip_init(nn.Linear, weight.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight.detach().t())
        lin.bias.copy_(bias.detach())
    return lin


class FusedQKV(nn.Module):
    """``c_attn`` as q, k and v projections: x -> [q(x) | k(x) | v(x)]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        h = weight.shape[1] // 3
        self.q = as_linear(weight[:, :h], bias[:h])
        self.k = as_linear(weight[:, h:2 * h], bias[h:2 * h])
        self.v = as_linear(weight[:, 2 * h:], bias[2 * h:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def linearize(model: nn.Module) -> nn.Module:
    """Every block of a ``GPT2LMHeadModel`` with ``nn.Linear`` layers (see the module)."""
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = FusedQKV(attn.c_attn.weight, attn.c_attn.bias)
        attn.c_proj = as_linear(attn.c_proj.weight, attn.c_proj.bias)
        mlp.c_fc = as_linear(mlp.c_fc.weight, mlp.c_fc.bias)
        mlp.c_proj = as_linear(mlp.c_proj.weight, mlp.c_proj.bias)
    return model
