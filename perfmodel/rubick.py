"""The Rubick (MLSys'25) artifact data shipped in `perfmodel/data/rubick`:
model shapes, global batches, measured placement rows and profiling runs,
mapped onto gearshift plans and resources, with the data's known quirks.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gearshift.perfmodel.memory import memory_feasible
from gearshift.perfmodel.plans import ConcretePlan, PlanArray, ResourceArray, Resources, divisors, plan_family
from gearshift.perfmodel.shapes import ModelShape

DATA_DIR = Path(__file__).parent / "data" / "rubick"

MODELS = ("vit", "roberta", "bert", "t5", "gpt2", "llama7", "llama30")

GLOBAL_BATCH = {"vit": 64, "roberta": 64, "bert": 32, "t5": 16, "gpt2": 16, "llama7": 8, "llama30": 4}

# Profile folder per model (llama30b's profile is a byte copy of llama7b's, so
# it is not used for llama30: see QUIRKS).
PROFILE_DIR = {"vit": "vit", "roberta": "roberta", "bert": "bert", "t5": "t5", "gpt2": "gpt2", "llama7": "llama7b"}

# Architecture facts. Parameter counts come from the profiles' parameter_size
# (x 2^20) where a profile exists; layers/hidden/seq from the public configs
# (GPT-2 XL, BERT/RoBERTa-large, ViT-B/16, LLaMA).  LLaMA-30B's artifact config
# holds placeholders, so its published shape is used.  RoBERTa and ViT train
# with HF Trainer AMP, whose gradients are fp32 on the wire.
_ARCH = {
    "vit": dict(layers=12, hidden=768, seq_len=197, heads=12, grad_bytes=4),
    "roberta": dict(layers=24, hidden=1024, seq_len=512, heads=16, grad_bytes=4),
    "bert": dict(layers=24, hidden=1024, seq_len=512, heads=16, grad_bytes=2),
    "t5": dict(layers=16, hidden=1280, seq_len=768, heads=16, grad_bytes=2),
    "gpt2": dict(layers=48, hidden=1600, seq_len=1024, heads=25, grad_bytes=2),
    "llama7": dict(layers=32, hidden=4096, seq_len=2048, heads=32, grad_bytes=2),
    "llama30": dict(layers=60, hidden=6656, seq_len=2048, heads=52, grad_bytes=2),
}
_PARAMS_M_FALLBACK = {"llama30": 32_528.9}

# Rows that measure something other than what their label says.
QUIRKS = {
    "roberta-half-batch": (
        "RoBERTa 1-GPU non-GC rows ran at half the global batch (ga@1 = ga@2 = 705 ms, "
        "zero-dp@1 = 684 ms, while gc@1 = 1760 ms = 2 x gc@2); predicted at batch 32, "
        "as the artifact's own validation does"
    ),
    "t5-profile-forward": "t5 profile forward_time=4 on 4 GPUs is a typo (80 on 2, 54 on 8): component ignored",
    "llama-profile-components": (
        "LLaMA profiles record Topt=1 and forward+Tcc > iter_time: only iteration time is used"
    ),
    "llama30-profile-copy": "llama30b profile is a byte copy of llama7b's: not used for llama30",
}


@functools.lru_cache(maxsize=None)
def _profile_params_m(model: str, data_dir: str) -> float | None:
    d = PROFILE_DIR.get(model)
    if d is None:
        return None
    with open(Path(data_dir) / "profile" / d / "config.csv", newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    return float(rows[0]["parameter_size"]) * 2**20 / 1e6


def rubick_shape(model: str, data_dir: str | Path = DATA_DIR) -> ModelShape:
    """`ModelShape` of one of the Rubick models, built from the shipped data."""
    if model not in _ARCH:
        raise KeyError(f"unknown Rubick model {model!r}; known: {', '.join(MODELS)}")
    pm = _profile_params_m(model, str(data_dir)) or _PARAMS_M_FALLBACK[model]
    return ModelShape(name=model, params_m=round(pm, 3), **_ARCH[model])


def rubick_global_batch(model: str) -> int:
    return GLOBAL_BATCH[model]


@dataclass(frozen=True)
class Row:
    """One measurement mapped onto a gearshift plan and resources."""

    model: str
    source: str  # "placement" or "profile"
    label: str  # the artifact's exec_plan label (or profile zero_type)
    placement: str
    plan: ConcretePlan
    resources: Resources
    global_batch: int
    iter_ms: float
    fwd_ms: float = float("nan")
    tcc_ms: float = float("nan")
    opt_ms: float = float("nan")
    quirk: str = ""
    weight: float = 1.0  # weight of the row's residual in a fit

    @property
    def family(self) -> str:
        return self.plan.family

    @property
    def multi_node(self) -> bool:
        return self.resources.n_nodes > 1

    @property
    def name(self) -> str:
        return f"{self.label}@{self.placement}"


def map_label(shape: ModelShape, label: str, placement: str, global_batch: int,
              threads: float = 4.0, gpu_mem_gb: float = 80.0) -> tuple[ConcretePlan, Resources, bool]:
    """Map an artifact (exec_plan, placement) onto the cheapest memory-feasible
    gearshift plan (fewest micro-steps).  Returns (plan, resources, feasible)."""
    res = Resources.from_placement(placement, threads)
    n = res.n_gpus
    if label in ("ga", "gc", "zero-dp", "zero-offload"):
        dp, tp, pp = n, 1, 1
        zero = 0 if label in ("ga", "gc") else 2
        off, gc = label == "zero-offload", label == "gc"
    elif len(label) == 3 and label.isdigit():
        pp, tp, dp = (int(c) for c in label)
        if pp * tp * dp != n:
            raise ValueError(f"3D plan {label} does not use the {n} GPUs of {placement}")
        zero, off, gc = 0, False, False
    else:
        raise ValueError(f"unknown exec_plan label {label!r}")
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} not divisible by dp={dp} ({label}@{placement})")
    local = global_batch // dp
    cands = [ConcretePlan(dp, tp, pp, zero, off, ga, local // ga, gc) for ga in divisors(local)]
    ok = memory_feasible(shape, PlanArray.from_plans(cands), gpu_mem_gb)
    for p, f in zip(cands, ok):
        if f:
            return p, res, True
    return cands[-1], res, False


def _float(x: str | None) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _component(x: str | None, scale: float) -> float:
    # 0 means "not recorded" in the artifact's tables.
    v = _float(x) * scale
    return v if v > 0 else float("nan")


def load_placements(model: str, data_dir: str | Path = DATA_DIR) -> list[Row]:
    """Measured rows (iter_time > 0) of placements/<model>.csv."""
    shape = rubick_shape(model, data_dir)
    B = GLOBAL_BATCH[model]
    rows = []
    with open(Path(data_dir) / "placements" / f"{model}.csv", newline="", encoding="utf-8-sig") as f:
        for r in csv.DictReader(f):
            it = _float(r["iter_time"])
            if not (it > 0):
                continue
            label, placement = r["exec_plan"], r["placement"]
            batch, quirk = B, ""
            if model == "roberta" and placement == "1" and label != "gc":
                batch, quirk = B // 2, "roberta-half-batch"
            plan, res, _ = map_label(shape, label, placement, batch)
            # The HF models (RoBERTa, ViT) record components in seconds.
            scale = 1000.0 if model in ("roberta", "vit") else 1.0
            rows.append(Row(
                model, "placement", label, placement, plan, res, batch, it * 1000.0,
                _component(r.get("forward"), scale),
                _component(r.get("overlap_sync"), scale),
                _component(r.get("optimize"), scale), quirk,
            ))
    return rows


def load_profile(model: str, data_dir: str | Path = DATA_DIR) -> list[Row]:
    """Single-node profiling runs used for fitting (empty for llama30)."""
    d = PROFILE_DIR.get(model)
    if d is None:
        return []
    shape = rubick_shape(model, data_dir)
    B = GLOBAL_BATCH[model]
    base = Path(data_dir) / "profile" / d
    with open(base / "config.csv", newline="", encoding="utf-8-sig") as f:
        cfg = list(csv.DictReader(f))
    with open(base / "data.csv", newline="", encoding="utf-8-sig") as f:
        dat = list(csv.DictReader(f))
    rows = []
    for c, m in zip(cfg, dat):
        label = {0: "ga", 1: "zero-offload", 2: "zero-dp"}[int(c["zero_type"])]
        placement = str(int(c["gpus"])) if int(c["nodes"]) == 1 else str(int(c["gpus"]) // int(c["nodes"])) * int(c["nodes"])
        threads = float(c["num_cpu_threads"]) if label == "zero-offload" else 4.0
        plan, res, _ = map_label(shape, label, placement, B, threads)
        fwd, tcc, opt = _float(m["forward_time"]), _float(m["Tcc"]), _float(m["Topt"])
        quirk = ""
        if model == "t5" and fwd < 10:
            fwd, quirk = float("nan"), "t5-profile-forward"
        if model.startswith("llama"):
            fwd = tcc = opt = float("nan")
            quirk = "llama-profile-components"
        rows.append(Row(model, "profile", label, placement, plan, res, B, _float(m["iter_time"]),
                        fwd, tcc, opt, quirk))
    return rows


def balance_weights(rows: list[Row]) -> list[Row]:
    """Give each (family, single/multi-node) group of a model's placement rows
    the same total weight, so that many multi-node rows do not buy their fit
    with the few single-node ones (profiling runs keep weight 1)."""
    import dataclasses

    groups: dict[tuple, int] = {}
    for r in rows:
        if r.source == "placement":
            groups[(r.model, family_of_label(r.label), r.multi_node)] = groups.get((r.model, family_of_label(r.label), r.multi_node), 0) + 1
    if not groups:
        return list(rows)
    mean = sum(groups.values()) / len(groups)
    return [
        dataclasses.replace(r, weight=float(np.sqrt(mean / groups[(r.model, family_of_label(r.label), r.multi_node)])))
        if r.source == "placement" else r
        for r in rows
    ]


def rows_to_arrays(rows: list[Row]) -> tuple[PlanArray, ResourceArray, np.ndarray]:
    plans = PlanArray.from_plans([r.plan for r in rows])
    res = ResourceArray.from_resources([r.resources for r in rows])
    y = np.array([r.iter_ms for r in rows], dtype=np.float64)
    return plans, res, y


def family_of_label(label: str) -> str:
    if label in ("ga", "gc", "zero-dp", "zero-offload"):
        return label
    return "3D"


__all__ = [
    "DATA_DIR", "MODELS", "GLOBAL_BATCH", "QUIRKS", "Row", "rubick_shape", "rubick_global_batch",
    "map_label", "load_placements", "load_profile", "rows_to_arrays", "family_of_label", "plan_family",
]
