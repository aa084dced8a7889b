"""One checkpoint format for every plan, resharded on load.

Layout of ``step-<n>/``: one ``rank-<r>.pt`` per rank that owns something
nobody else writes, each a list of *pieces*::

    {"name": "blocks.1.up.weight", "shape": full shape, "tp_dim": 0, "tp": 2,
     "tp_rank": 1, "lo": a, "hi": b}   + param / exp_avg / exp_avg_sq values

meaning: of the full tensor, TP rank ``tp_rank``'s slice (of ``tp`` along
``tp_dim``), flattened, elements ``a:b``. That covers a TP slice, a ZeRO
shard (which cuts across parameters of the flat buffer) and both at once.
A replica (DP without ZeRO, a TP-replicated parameter) is written once. Plus
``meta.pt`` from rank 0: the step (the data position: step ``s`` reads the
global samples ``perm[s*B:(s+1)*B]``, the same under every plan), the Adam
step count, the sampler seed, the loss and the RNG states (torch, CUDA,
Python, numpy) of every rank.

Loading assembles the full tensors from the pieces (checking every element
was written exactly once) and cuts out what this rank holds under the new
plan, so any plan loads any other plan's checkpoint.

Why not ``torch.distributed.checkpoint`` (DCP): DCP reshards DTensor and
ShardedTensor state; our TP slices and, above all, the ZeRO shards of a flat
buffer that cut parameters at arbitrary element offsets are plain tensors it
cannot describe, so DCP would need a DTensor rewrite of the whole workload
(DeviceMesh over pp x dp x tp, and flat ZeRO shards DTensor cannot express)
for a 1 M-parameter model. The format above is DCP's idea (every rank writes
its own part plus metadata, reshard at load) in ~100 lines.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from gearshift.agent.reference.model import local_slice, tp_dim

KEYS = ("param", "exp_avg", "exp_avg_sq")


def rank_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank:05d}.pt"


def pieces(opt: Any, layout: Any, full_shapes: dict[str, tuple]) -> dict | None:
    """What this rank writes, or None when another rank writes the same values."""
    if opt.zero == 0 and layout.dp_rank != 0:
        return None  # a replica of DP rank 0
    st = opt.state()
    out: dict[str, Any] = {"pieces": [], **{k: [] for k in KEYS}}
    for name, p, a, b, at in opt.ranges():
        d = tp_dim(name)
        if layout.tp > 1 and d is None and layout.tp_rank != 0:
            continue  # replicated over TP: TP rank 0 writes it
        out["pieces"].append({"name": name, "shape": tuple(full_shapes[name]), "tp_dim": d,
                              "tp": layout.tp if d is not None else 1,
                              "tp_rank": layout.tp_rank if d is not None else 0, "lo": a, "hi": b})
        for k in KEYS:
            out[k].append(st[k][at:at + b - a].detach().cpu().clone())
    return out if out["pieces"] else None


def rng_state(torch: Any) -> dict:
    import numpy as np

    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(torch: Any, st: dict) -> None:
    import numpy as np

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(torch: Any, folder: Path, opt: Any, layout: Any, full_shapes: dict, meta: dict, dist: Any) -> None:
    """Every rank calls it (collective: the RNG states are gathered to rank 0)."""
    mine = pieces(opt, layout, full_shapes)
    if mine is not None:
        torch.save(mine, rank_file(folder, layout.rank))
    rngs = [None] * layout.world if layout.rank == 0 else None
    dist.gather_object(rng_state(torch), rngs, dst=0)
    if layout.rank == 0:
        torch.save({**meta, "adam_step": opt.state()["adam_step"], "rng": rngs}, Path(folder) / "meta.pt")


def load_full(torch: Any, folder: Path) -> tuple[dict, dict]:
    """(meta, {name: {param, exp_avg, exp_avg_sq}: full tensors}) from any plan's checkpoint."""
    folder = Path(folder)
    meta = torch.load(folder / "meta.pt", map_location="cpu", weights_only=False)
    full: dict[str, dict] = {}
    filled: dict[str, int] = {}
    for f in sorted(folder.glob("rank-*.pt")):
        part = torch.load(f, map_location="cpu", weights_only=False)
        for i, pc in enumerate(part["pieces"]):
            name = pc["name"]
            if name not in full:
                full[name] = {k: torch.zeros(pc["shape"]) for k in KEYS}
            for k in KEYS:
                local = local_slice(full[name][k], name, pc["tp"], pc["tp_rank"]) if pc["tp_dim"] is not None \
                    else full[name][k]
                flat = local.reshape(-1).clone()
                flat[pc["lo"]:pc["hi"]] = part[k][i]
                local.copy_(flat.view(local.shape))
            filled[name] = filled.get(name, 0) + pc["hi"] - pc["lo"]
    for name, t in full.items():
        if filled[name] != t["param"].numel():
            raise ValueError(f"checkpoint {folder}: {name} has {filled[name]} of {t['param'].numel()} elements")
    return meta, full


def restore(torch: Any, opt: Any, layout: Any, full: dict, adam_step: int) -> None:
    """Cut this rank's share out of the full state and load it into ``opt``."""
    flat = {k: torch.zeros(opt.padded) for k in KEYS}
    for name, p, o in zip(opt.names, opt.params, opt.offsets):
        if name not in full:
            raise ValueError(f"checkpoint has no parameter {name}")
        for k in KEYS:
            src = local_slice(full[name][k], name, layout.tp, layout.tp_rank)
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint {name}: shape {tuple(src.shape)}, this plan wants {tuple(p.shape)}")
            flat[k][o:o + p.numel()] = src.reshape(-1)
    opt.load(flat, adam_step)


def fresh(full_params: dict, torch: Any) -> dict:
    """A full state from initial parameters (no optimizer state yet)."""
    return {n: {"param": t, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
            for n, t in full_params.items()}


def restore_rng(torch: Any, meta: dict, rank: int) -> None:
    rngs = meta.get("rng") or []
    if rngs:
        set_rng_state(torch, rngs[rank] if rank < len(rngs) else rngs[0])


def exists(folder: Path) -> bool:
    return (Path(folder) / "meta.pt").exists()

