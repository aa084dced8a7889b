"""Ready-fitted models for the Rubick workloads, so the simulator and the
policies can use the performance model without profiling anything.

The joint fit over every shipped row (profiles + placements) takes tens of
seconds, so its result is stored in `data/fitted_rubick.json` and reused while
the model version and parameter names match; `python -m perfmodel.catalog`
refits and rewrites it.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np

from gearshift.perfmodel.fit import fit_joint
from gearshift.perfmodel.model import CLUSTER_NAMES, PARAM_NAMES, PARAM_PRIOR, PerfParams
from gearshift.perfmodel.plans import Resources, as_plan
from gearshift.perfmodel.predict import predict
from gearshift.perfmodel.rubick import (
    DATA_DIR,
    MODELS,
    balance_weights,
    load_placements,
    load_profile,
    rubick_global_batch,
    rubick_shape,
)
from gearshift.perfmodel.shapes import ModelShape
from gearshift.perfmodel.validate import TRAINING_ROWS, is_artefact_row, profiled_data

# Bump whenever the model's formulas change: stored fits are then recomputed.
MODEL_VERSION = "gearshift-perfmodel-5"
FITTED_PATH = Path(__file__).parent / "data" / "fitted_rubick.json"
# The belief: fitted on the profiling runs and the <= 7 rule-chosen rows only.
BELIEF_PATH = Path(__file__).parent / "data" / "fitted_rubick_profiled.json"


def fit_profiled_rows(data_dir=DATA_DIR) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The fit the live system could have: each model's profiling runs plus at
    most 7 configurations chosen by the profiler's rule (``validate.profiled_data``),
    as ``perfmodel validate`` fits its held-out model. Never any other row."""

    return fit_joint(profiled_data(data_dir)[4])


def fit_all_rows(data_dir=DATA_DIR) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    prof = {m: load_profile(m, data_dir) for m in MODELS}
    # Cells that measure the testbed rather than the plan (ViT's multi-node
    # non-offload rows) would drag the fit away from everything the scheduler asks.
    rows = {m: [r for r in load_placements(m, data_dir) if not is_artefact_row(r)] for m in MODELS}
    shapes = {m: rubick_shape(m, data_dir) for m in MODELS}
    # The small design first, then all rows warm-started from it: the all-rows
    # fit alone can settle in a worse optimum (e.g. LLaMA's offload rows).
    small = fit_joint({m: (shapes[m], prof[m] + [r for r in rows[m] if r.name in TRAINING_ROWS[m]]) for m in MODELS})
    return fit_joint({m: (shapes[m], prof[m] + balance_weights(rows[m])) for m in MODELS}, init=small)


def _write(path: Path, cluster: np.ndarray, thetas: dict[str, np.ndarray]) -> None:
    doc = {
        "model_version": MODEL_VERSION,
        "cluster": {n: float(v) for n, v in zip(CLUSTER_NAMES, cluster)},
        "models": {
            m: {"model_key": rubick_shape(m).key, "params": {n: float(v) for n, v in zip(PARAM_NAMES, th)}}
            for m, th in thetas.items()
        },
    }
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _read(path: Path):
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("model_version") != MODEL_VERSION or set(doc.get("cluster", {})) != set(CLUSTER_NAMES):
        return None
    cl = np.array([doc["cluster"][n] for n in CLUSTER_NAMES])
    ths = {}
    for m, d in doc.get("models", {}).items():
        # a parameter appended since the fit was stored takes its prior centre (PerfParams.from_dict does too)
        if set(d["params"]) - set(PARAM_NAMES) or m not in MODELS or d["model_key"] != rubick_shape(m).key:
            return None
        ths[m] = np.array([d["params"].get(n, PARAM_PRIOR[n][0]) for n in PARAM_NAMES])
    if set(ths) != set(MODELS):
        return None
    return cl, ths


def _stored(path: Path, fit) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    got = _read(path)
    if got is None:
        got = fit()
        try:
            _write(path, *got)
        except OSError:
            pass  # read-only install: keep it in memory only
    return got


@functools.lru_cache(maxsize=1)
def shipped_fit() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(cluster constants, {model: theta}) fitted on all shipped Rubick rows: the
    model's in-sample capacity. Not a belief any scheduler could hold (it has seen
    every measured row); the simulator's extended truth starts from it."""
    return _stored(FITTED_PATH, fit_all_rows)


@functools.lru_cache(maxsize=1)
def belief_fit() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(cluster constants, {model: theta}) fitted only on what profiling measures
    (``fit_profiled_rows``): the belief of the simulator and the optimizer."""
    return _stored(BELIEF_PATH, fit_profiled_rows)


def shipped_cluster() -> np.ndarray:
    """Cluster constants (bandwidths, latency) fitted once across all models."""
    return shipped_fit()[0].copy()


@functools.lru_cache(maxsize=None)
def fitted_model_for(name: str, fit: str = "in_sample") -> PerfParams:
    """Fitted parameters of a Rubick model (vit, roberta, bert, t5, gpt2, llama7, llama30).
    ``fit``: "in_sample" (every row, ``shipped_fit``) or "belief" (profiling only)."""
    if name not in MODELS:
        raise KeyError(f"no fitted model for {name!r}; known: {', '.join(MODELS)}")
    cl, ths = (belief_fit if fit == "belief" else shipped_fit)()
    return PerfParams(rubick_shape(name).key, ths[name], cl)


def belief_model_for(name: str) -> PerfParams:
    """The belief's parameters of a Rubick model (fitted on its profiling only)."""
    return fitted_model_for(name, "belief")


def rubick_job(name: str) -> tuple[ModelShape, int]:
    """(shape, global batch) of a Rubick workload model."""
    return rubick_shape(name), rubick_global_batch(name)


def params_for_shape(shape: ModelShape, fit: str = "belief") -> PerfParams:
    """Fitted parameters for any shape: the Rubick model of that name, else the
    Rubick model nearest in parameter count with its compute terms scaled by
    params x sequence length (a heuristic until the job is profiled). By default
    the belief (profiling-only fit); ``fit="in_sample"`` for the all-rows fit."""
    if shape.name in MODELS:
        p = fitted_model_for(shape.name, fit)
        return PerfParams(shape.key, p.theta, p.cluster, p.gpu_mem_gb)
    ref = min(MODELS, key=lambda m: abs(np.log(rubick_shape(m).params_m / shape.params_m)))
    base, rs = fitted_model_for(ref, fit), rubick_shape(ref)
    scale = (shape.params_m * shape.seq_len) / (rs.params_m * rs.seq_len)
    theta = base.theta.copy()
    for name in ("t_fwd", "t_3d"):
        theta[PARAM_NAMES.index(name)] *= scale
    return PerfParams(shape.key, theta, base.cluster, base.gpu_mem_gb)


def shape_from_spec(model) -> ModelShape:
    """ModelShape from a bus ModelSpec-like object (name, params, layers, hidden, seq_len, heads)."""
    name = str(getattr(model, "name"))
    if name in MODELS:
        return rubick_shape(name)
    return ModelShape(name=name, params_m=float(getattr(model, "params")), layers=int(getattr(model, "layers")),
                      hidden=int(getattr(model, "hidden")), seq_len=int(getattr(model, "seq_len")),
                      heads=int(getattr(model, "heads", 0) or 0), kv_heads=int(getattr(model, "kv_heads", 0) or 0))


def with_nic_scale(params: PerfParams, scale: float) -> PerfParams:
    """``params`` with the inter-node bandwidth (``bw_nic``) times ``scale``: how the model
    prices a placement spanning a slower topology level."""
    cluster = np.array(params.cluster, dtype=np.float64)
    cluster[CLUSTER_NAMES.index("bw_nic")] *= scale
    return PerfParams(params.model_key, params.theta, cluster, params.gpu_mem_gb)


def sim_predictor(gpus_per_node: int = 8, fit: str = "belief"):
    """The simulator's hook: predictor(spec, plan, per_node) -> seconds per step
    (0 when the plan does not fit or is not valid on that placement). ``fit``:
    "belief" (profiling-only, what policies get) or "in_sample" (all rows; the
    extended regime's truth starts from it)."""

    cache: dict = {}

    def predictor(spec, plan, per_node, nic_scale: float = 1.0) -> float:
        """``nic_scale``: the inter-node bandwidth as a factor of the fitted one (the
        topology level a placement spans, ``bus_schema.topology.LinkFactors``)."""
        shares = tuple(int(k) for k in per_node if int(k) > 0)
        if not shares:
            return 0.0
        threads = float(getattr(spec, "cpus_per_gpu", None) or 4.0)
        m = spec.model
        mkey = (m.name, m.params, m.layers, m.hidden, m.seq_len, getattr(m, "heads", None), getattr(m, "kv_heads", None))
        pl = as_plan(plan, int(spec.global_batch))
        key = (mkey, int(spec.global_batch), pl, shares, threads, nic_scale)
        hit = cache.get(key)
        if hit is None:
            shape = shape_from_spec(spec.model)
            params = params_for_shape(shape, fit)
            if nic_scale != 1.0:
                params = with_nic_scale(params, nic_scale)
            pr = predict(params, shape, int(spec.global_batch), [pl], Resources(shares, threads), engine="numpy")
            hit = float(pr.iter_time_s[0]) if pr.feasible[0] else 0.0
            cache[key] = hit
        return hit

    return predictor


def main(argv: list[str] | None = None) -> int:
    cl, ths = fit_all_rows()
    _write(FITTED_PATH, cl, ths)
    print(f"wrote {FITTED_PATH}")
    _write(BELIEF_PATH, *fit_profiled_rows())
    print(f"wrote {BELIEF_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
