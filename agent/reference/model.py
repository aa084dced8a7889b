"""The reference model: a residual MLP classifier (``inp`` -> blocks -> ``out``),
each block ``x + down(gelu(up(norm(x))))``, as one rank of a plan holds it.

- TP (Megatron): ``up`` is column-parallel (its output features split over
  the TP group), ``down`` row-parallel (its input features split, partial
  sums all-reduced, bias added after); norms, ``inp`` and ``out`` are
  replicated.
- PP: stage ``s`` holds a contiguous run of blocks; stage 0 also ``inp``, the
  last stage ``out``.
- Parameter names are the same under every plan (``blocks.<global i>.up.weight``)
  and ``tp_dim`` says which dimension of the full tensor a TP rank holds a
  slice of, so a checkpoint can be resharded between plans (``ckpt.py``).
"""

from __future__ import annotations

from typing import Any

# full name suffix -> the dimension TP splits (absent: replicated)
TP_DIM = {"up.weight": 0, "up.bias": 0, "down.weight": 1}


def tp_dim(name: str) -> int | None:
    for suffix, d in TP_DIM.items():
        if name.endswith(suffix):
            return d
    return None


def stage_blocks(layers: int, pp: int, stage: int) -> range:
    """Blocks of pipeline stage ``stage``: contiguous, sizes differ by at most one."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def full_init(args: Any, torch: Any) -> dict:
    """The initial parameters of the whole model (seeded; the same for every plan)."""
    nn = torch.nn
    torch.manual_seed(args.seed)
    h = args.hidden
    mods: dict[str, Any] = {"inp": nn.Linear(args.dim, h)}
    for i in range(args.layers):
        mods[f"blocks.{i}.norm"] = nn.LayerNorm(h)
        mods[f"blocks.{i}.up"] = nn.Linear(h, 4 * h)
        mods[f"blocks.{i}.down"] = nn.Linear(4 * h, h)
    mods["out"] = nn.Linear(h, args.classes)
    return {f"{m}.{p}": t.detach().clone() for m, mod in mods.items() for p, t in mod.named_parameters()}


def local_slice(full, name: str, tp: int, tp_rank: int):
    d = tp_dim(name)
    if d is None or tp == 1:
        return full
    n = full.shape[d] // tp
    return full.narrow(d, tp_rank * n, n)


def build_local(args: Any, torch: Any, layout: Any, comm: Any):
    """This rank's part of the model, parameters uninitialised (``load`` fills them)."""
    from gearshift.agent.reference.parallel import tp_ops

    nn = torch.nn
    F = torch.nn.functional
    copy, reduce = tp_ops(torch, comm)
    tp, h = layout.tp, args.hidden
    if (4 * h) % tp:
        raise ValueError(f"tp {tp} must divide the block width {4 * h}")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up = nn.Linear(h, 4 * h // tp)  # column-parallel
            self.down = nn.Linear(4 * h // tp, h, bias=False)  # row-parallel: bias after the reduction
            self.down.register_parameter("bias", nn.Parameter(torch.zeros(h)))

        def forward(self, x):
            z = F.gelu(self.up(copy(self.norm(x))))
            return x + reduce(F.linear(z, self.down.weight)) + self.down.bias

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(args.dim, h) if layout.first_stage else None
            self.blocks = nn.ModuleDict({str(i): Block() for i in stage_blocks(args.layers, layout.pp, layout.stage)})
            self.out = nn.Linear(h, args.classes) if layout.last_stage else None
            self.grad_ckpt = False

        def forward(self, x):
            if self.inp is not None:
                x = self.inp(x)
            for b in self.blocks.values():
                if self.grad_ckpt and self.training:
                    x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                else:
                    x = b(x)
            return self.out(x) if self.out is not None else x

    return Stage()
