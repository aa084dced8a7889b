"""`gearshift perfmodel validate [--data DIR] [-o json]`

For each Rubick model: fit from its profiling runs plus at most 7 rows of its
placements table chosen by a fixed rule (`training_rows`; named in the output),
in one joint fit (the cluster constants are shared), predict every other
measured row, and report the relative error of iteration time by model x plan
family x single/multi-node, with row counts and pooled averages.  Beside it:
the in-sample error (`capacity_fit`: every row fitted, the model's capacity),
and the artifact's own model (profile/history.csv parameters) on the same
held-out rows and on all rows; for every cell where the artifact is better the
rows are listed.  Exit status 1 if the pooled average over all rows exceeds 12%
or a cell not marked as a data artefact exceeds 20% average.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from gearshift.perfmodel.artifact import artifact_iter_ms, history_params
from gearshift.perfmodel.fit import fit_joint
from gearshift.perfmodel.memory import memory_feasible
from gearshift.perfmodel.model import CLUSTER_NAMES, PARAM_NAMES, iteration_time_ms, shape_consts
from gearshift.perfmodel.plans import ConcretePlan, PlanArray, Resources, divisors
from gearshift.perfmodel.rubick import (
    DATA_DIR,
    GLOBAL_BATCH,
    MODELS,
    QUIRKS,
    balance_weights,
    family_of_label,
    load_placements,
    load_profile,
    map_label,
    rows_to_arrays,
    rubick_shape,
)

POOLED_LIMIT = 0.12
CELL_LIMIT = 0.20
FAMILY_ORDER = ("ga", "gc", "zero-dp", "zero-offload", "3D")

# The rows (besides the profiling runs) each model is fitted from are chosen by
# `training_rows`, a rule fixed in advance and applied the same way to every
# model; it looks only at which plans the profiling runs cover, never at errors.
# 3D models name their 3D rows here (the profiles hold no 3D run): a small
# single-node shape, a 4-node and an 8-node shape; LLaMA's tables hold only 3D
# rows (and LLaMA-30B has no profile), so all seven of theirs are 3D shapes
# spread over tp, pp, dp and node counts.
THREE_D_ROWS = {
    "t5": ["181@8", "441@4444", "821@22222222"],
    "gpt2": ["151@5", "411@1111", "851@55555555"],
    "llama7": ["182@88", "244@8888", "481@8888", "841@44444444", "224@22222222", "188@88888888", "428@88888888"],
    "llama30": ["444@88888888", "344@66666666", "524@88888", "641@444444", "442@8888", "642@888888", "542@88888"],
}
# Multi-node data-parallel coverage, in priority order: two full nodes (the
# inter-node ring and the multi-node compute factor), ZeRO across four nodes
# (its reduce-scatter and all-gather over the NICs), offload across four nodes,
# one GPU per node, an uneven placement with an odd share (the odd-share term).
ODD_SHARE_ROW = "ga@35"
MULTI_NODE_ROWS = ["ga@44", "zero-dp@2222", "zero-offload@2222", "ga@11111111", ODD_SHARE_ROW]
# How many of MULTI_NODE_ROWS come before the sync-free ga@1 point.
MULTI_NODE_FIRST = 2
MAX_TRAINING_ROWS = 7


def training_rows(model: str, profile, placements) -> list[str]:
    """The <= 7 placement rows `model` is fitted from besides its profiling runs.

    Priority (stop at 7; a row is skipped if not measured or in a data-artefact cell):
    1. single node, per DP family (gc, zero-dp, zero-offload): a family the profiles
       do not cover gets its 8-GPU row; a family covered at one GPU count only gets
       the row at the other end (8 GPUs, or 1 if the profile ran on 8);
    2. the model's named 3D rows (`THREE_D_ROWS`);
    3. the first two multi-node rows (two full nodes; ZeRO across four nodes);
    4. `ga@1` when no profile ran on one GPU without offload: the only measurement
       of compute free of any gradient sync;
    5. the other multi-node rows (the odd-share row even in an artefact cell: it
       alone identifies d_odd).
    """
    measured = {r.name: r for r in placements}
    prof = {}
    for r in profile:
        if not r.multi_node:
            prof.setdefault(family_of_label(r.label), set()).add(r.resources.n_gpus)
    out: list[str] = []

    def add(name):
        r = measured.get(name)
        if r is None or name in out or len(out) >= MAX_TRAINING_ROWS:
            return
        # The uneven odd-share row is the one row that identifies the odd-share
        # term d_odd (nothing else in the model applies to it), so it is kept
        # even where that effect makes its cell a data artefact.
        if (model, family_of_label(r.label), r.multi_node) in ARTEFACT_CELLS and name != ODD_SHARE_ROW:
            return
        out.append(name)

    if any(family_of_label(r.label) != "3D" for r in placements):
        for fam in ("gc", "zero-dp", "zero-offload"):
            got = prof.get(fam, set())
            if not got:
                add(f"{fam}@8")
            elif len(got) == 1:
                add(f"{fam}@{1 if 8 in got else 8}")
    for name in THREE_D_ROWS.get(model, []):
        add(name)
    for name in MULTI_NODE_ROWS[:MULTI_NODE_FIRST]:
        add(name)
    if 1 not in prof.get("ga", set()) | prof.get("zero-dp", set()):
        add("ga@1")
    for name in MULTI_NODE_ROWS[MULTI_NODE_FIRST:]:
        add(name)
    return out


# Cells whose rows measure the testbed rather than the plan (see `_artefact_evidence`).
ARTEFACT_CELLS = {
    ("vit", "ga", True): "vit-odd-placement",
    ("vit", "gc", True): "vit-odd-placement",
    ("vit", "zero-dp", True): "vit-odd-placement",
}
ARTEFACT_REASONS = {
    "vit-odd-placement": (
        "ViT (HF Trainer) multi-node rows depend on which nodes hold an odd number of GPUs, not on "
        "bandwidth: at 8 GPUs, uneven placements with an odd share take 3-9x the even ones and the "
        "excess varies from ~40 to ~400 ms with no resource pattern (evidence below); "
        "ZeRO-Offload rows (DeepSpeed, pinned CPU cores) do not show it, so it is a "
        "testbed effect (CPU/NUMA affinity or NCCL topology), not a plan property"
    ),
}


def is_artefact_row(row) -> bool:
    """A row of a cell marked as a data artefact (kept out of the shipped fit)."""
    return (row.model, family_of_label(row.label), row.multi_node) in ARTEFACT_CELLS


# The artifact's hand tables (sched/models/<m>.py): largest per-GPU batch of
# the data-parallel plans (0 = not allowed) and the 3D (plan, placement) pairs.
ARTIFACT_MAX_ATOM = {
    "bert": {"ga": 32, "gc": 32, "zero-dp": 32, "zero-dp+gc": 0, "zero-offload": 32, "zero-offload+gc": 0},
    "gpt2": {"ga": 16, "gc": 16, "zero-dp": 16, "zero-dp+gc": 0, "zero-offload": 16, "zero-offload+gc": 0},
    "t5": {"ga": 16, "gc": 16, "zero-dp": 16, "zero-dp+gc": 0, "zero-offload": 16, "zero-offload+gc": 0},
    "vit": {"ga": 64, "gc": 64, "zero-dp": 64, "zero-dp+gc": 0, "zero-offload": 64, "zero-offload+gc": 0},
    "roberta": {"ga": 64, "gc": 64, "zero-dp": 64, "zero-dp+gc": 0, "zero-offload": 64, "zero-offload+gc": 0},
    "llama7": {"ga": 0, "gc": 0, "zero-dp": 2, "zero-dp+gc": 0, "zero-offload": 8, "zero-offload+gc": 0},
    "llama30": {"ga": 0, "gc": 0, "zero-dp": 2, "zero-dp+gc": 0, "zero-offload": 8, "zero-offload+gc": 0},
}
ARTIFACT_3D = {
    "gpt2": {"151": ["5"], "251": ["55"], "351": ["555"], "411": ["1111"], "451": ["5555"], "611": ["111111"],
             "651": ["555555"], "811": ["11111111"], "851": ["55555555"]},
    "t5": {p: [pl] for p, pl in [("141", "4"), ("181", "8"), ("221", "22"), ("241", "44"), ("281", "88"),
                                  ("321", "222"), ("341", "444"), ("381", "888"), ("411", "1111"), ("421", "2222"),
                                  ("441", "4444"), ("481", "8888"), ("611", "111111"), ("621", "222222"),
                                  ("641", "444444"), ("681", "888888"), ("811", "11111111"), ("821", "22222222"),
                                  ("841", "44444444"), ("881", "88888888")]},
    "llama7": {"248": ["88888888"], "284": ["88888888"], "428": ["88888888"], "444": ["88888888"],
               "188": ["88888888"], "184": ["8888"], "228": ["8888", "44444444"], "482": ["88888888"],
               "148": ["8888", "44444444"], "282": ["8888"], "182": ["88"], "144": ["88", "4444"],
               "244": ["8888", "44444444"], "818": ["88888888"], "424": ["8888", "44444444"],
               "418": ["8888", "44444444"], "824": ["88888888"], "224": ["88", "4444", "22222222"],
               "242": ["88", "4444"], "442": ["8888", "44444444"], "842": ["88888888"], "281": ["88"],
               "481": ["8888"], "881": ["88888888"], "814": ["44444444"], "414": ["4444", "22222222"],
               "422": ["4444", "22222222"], "822": ["44444444"], "441": ["4444"], "841": ["44444444"],
               "812": ["22222222"], "821": ["22222222"]},
    "llama30": {"444": ["88888888"], "344": ["888888", "66666666"], "624": ["888888"], "524": ["88888", "55555555"],
                "542": ["88888"], "642": ["888888", "66666666"], "442": ["8888"], "641": ["444444"]},
}


def _cells(rows, err):
    out: dict[tuple, list[float]] = {}
    for r, e in zip(rows, err):
        out.setdefault((r.model, family_of_label(r.label), r.multi_node), []).append(float(e))
    return out


def _stat(v):
    return {"avg": float(np.mean(v)), "max": float(np.max(v)), "rows": len(v)} if len(v) else None


def _artefact_evidence(data_dir) -> dict:
    rows = [r for r in load_placements("vit", data_dir) if r.label in ("ga", "gc", "zero-dp")]
    ev = {}
    for lab in ("ga", "gc", "zero-dp"):
        r8 = [r for r in rows if r.label == lab and r.resources.n_gpus == 8 and r.multi_node]
        odd = [r for r in r8 if any(k % 2 for k in r.resources.gpus_per_node) and len(set(r.resources.gpus_per_node)) > 1]
        even = [r for r in r8 if not any(k % 2 for k in r.resources.gpus_per_node)]
        if odd and even:
            ev[lab] = {
                "even_8gpu_ms": {r.placement: round(r.iter_ms, 1) for r in even},
                "uneven_odd_8gpu_ms": {r.placement: round(r.iter_ms, 1) for r in odd},
            }
    return ev


def _feasibility_report(data_dir) -> dict:
    """Memory model vs measured rows and vs the artifact's hand tables."""
    measured_infeasible = []
    n_rows = 0
    for m in MODELS:
        shape = rubick_shape(m, data_dir)
        for r in load_placements(m, data_dir) + load_profile(m, data_dir):
            n_rows += 1
            _, _, ok = map_label(shape, r.label, r.placement, r.global_batch)
            if not ok:
                measured_infeasible.append(f"{m}:{r.name}")
    ruled_out, extra = [], []
    compared = 0
    for m in MODELS:
        shape, B = rubick_shape(m, data_dir), GLOBAL_BATCH[m]
        for N in (1, 2, 3, 4, 5, 6, 7, 8):
            if B % N:
                continue
            atom = B // N
            for fam, tab in ARTIFACT_MAX_ATOM[m].items():
                zero = 0 if fam in ("ga", "gc") else 2
                off = fam.startswith("zero-offload")
                gc = fam == "gc" or fam.endswith("+gc")
                cands = PlanArray.from_plans(
                    [ConcretePlan(N, 1, 1, zero, off, ga, atom // ga, gc) for ga in divisors(atom)])
                mine = bool(memory_feasible(shape, cands).any())
                theirs = 0 < atom <= tab
                compared += 1
                if theirs and not mine:
                    ruled_out.append(f"{m}:{fam}@{N}")
                if mine and not theirs:
                    extra.append(f"{m}:{fam}@{N}")
        for plc in sorted({p for pls in ARTIFACT_3D.get(m, {}).values() for p in pls}):
            res = Resources.from_placement(plc)
            n, k = res.n_gpus, min(res.gpus_per_node)
            listed = {lab for lab, pls in ARTIFACT_3D[m].items() if plc in pls}
            for tp in divisors(n):
                for pp in divisors(n // tp):
                    if tp == 1 and pp == 1:
                        continue
                    dp = n // (tp * pp)
                    if tp > 9 or pp > 9 or dp > 9 or B % dp or tp > k:
                        continue
                    lab = f"{pp}{tp}{dp}"
                    _, _, mine = map_label(shape, lab, plc, B)
                    theirs = lab in listed
                    compared += 1
                    if theirs and not mine:
                        ruled_out.append(f"{m}:{lab}@{plc}")
                    if mine and not theirs:
                        extra.append(f"{m}:{lab}@{plc}")
    return {
        "measured_rows": n_rows,
        "measured_rows_predicted_infeasible": measured_infeasible,
        "compared_plans": compared,
        "artifact_allowed_we_rule_out": ruled_out,
        "we_allow_artifact_did_not": len(extra),
        "we_allow_artifact_did_not_examples": extra[:12],
    }


CAPACITY_ROUNDS = 6


def capacity_fit(shapes, prof, rows, cluster, thetas, held_out: dict, training: dict, rounds: int = CAPACITY_ROUNDS):
    """In-sample fit on every row (profiles + the whole placements table): the
    model's capacity.  Per model, with the cluster constants of the held-out fit
    (hardware, shared), warm-started from the held-out parameters so that no
    capacity is lost to a worse local optimum.  Rows are weighted so each
    family x single/multi cell counts the same, and a cell whose in-sample error
    on its held-out rows comes out above the held-out fit's error on the same
    rows (`held_out`: cell -> mean) gets its weight raised by that ratio and
    the fit is redone (a few rounds): one parameter set trades cells against
    each other, and this trade should not leave a cell worse than a fit that
    never saw it.  Returns (cluster, {model: theta}, errors of all rows in
    MODELS order)."""
    import dataclasses

    ths = {m: thetas[m] for m in MODELS}
    mult: dict[tuple, float] = {}

    def key(r):
        return (r.model, family_of_label(r.label), r.multi_node)

    errs: dict[str, np.ndarray] = {}
    for rnd in range(rounds):
        data = {}
        for m in MODELS:
            placed = [dataclasses.replace(r, weight=r.weight * mult.get(key(r), 1.0)) for r in balance_weights(rows[m])]
            data[m] = (shapes[m], prof[m] + placed)
        _, fitted = fit_joint(data, cluster=cluster, init=(cluster, ths), n_starts=0)
        cand, cand_errs = {}, {}
        for m in MODELS:
            p, res, y = rows_to_arrays(rows[m])
            cand[m] = fitted[m]
            cand_errs[m] = np.abs(iteration_time_ms(fitted[m], cluster, shape_consts(shapes[m]), p, res) - y) / y
        # Keep a model's new fit unless it is clearly worse over all its rows.
        for m in MODELS:
            if m not in errs or np.mean(cand_errs[m]) <= np.mean(errs[m]) * 1.10:
                ths[m], errs[m] = cand[m], cand_errs[m]
        above = False
        for m in MODELS:
            cells: dict[tuple, list[float]] = {}
            for r, e in zip(rows[m], errs[m]):
                if r.name not in training[m]:
                    cells.setdefault(key(r), []).append(float(e))
            for k, v in cells.items():
                if k in held_out and k not in ARTEFACT_CELLS and np.mean(v) > held_out[k] > 0:
                    mult[k] = mult.get(k, 1.0) * min(4.0, (float(np.mean(v)) / held_out[k]) ** 4)
                    above = True
        if not above:
            break
    return cluster, ths, [float(e) for m in MODELS for e in errs[m]]


def profiled_data(data_dir=DATA_DIR):
    """What the live system knows of each model before it schedules it: its
    profiling runs plus the <= 7 configurations the rule picks (``training_rows``,
    chosen without looking at their times). Returns (rows, prof, shapes, training,
    fit data for ``fit_joint``). The belief (``perfmodel.catalog.belief_fit``) and
    the held-out validation are both fitted on exactly this."""
    rows = {m: load_placements(m, data_dir) for m in MODELS}
    prof = {m: load_profile(m, data_dir) for m in MODELS}
    shapes = {m: rubick_shape(m, data_dir) for m in MODELS}
    training = {m: training_rows(m, prof[m], rows[m]) for m in MODELS}
    train = {m: (shapes[m], prof[m] + [r for r in rows[m] if r.name in training[m]]) for m in MODELS}
    return rows, prof, shapes, training, train


def run(data_dir=DATA_DIR) -> dict:
    t0 = time.perf_counter()
    data_dir = Path(data_dir)
    rows, prof, shapes, training, train = profiled_data(data_dir)
    cl_oos, th_oos = fit_joint(train)
    hist = history_params(data_dir)

    test_rows, e_oos, all_rows, e_in, e_art, e_art_test, pred_oos, pred_art = [], [], [], [], [], [], [], []
    for m in MODELS:
        test = [r for r in rows[m] if r.name not in training[m]]
        p, res, y = rows_to_arrays(test)
        pred = iteration_time_ms(th_oos[m], cl_oos, shape_consts(shapes[m]), p, res)
        test_rows += test
        e_oos += list(np.abs(pred - y) / y)
        pred_oos += list(pred)
        art_t = [artifact_iter_ms(m, r.label, r.placement, hist) for r in test]
        pred_art += art_t
        e_art_test += [abs(a - r.iter_ms) / r.iter_ms for a, r in zip(art_t, test)]
        all_rows += rows[m]
        e_art += [abs(artifact_iter_ms(m, r.label, r.placement, hist) - r.iter_ms) / r.iter_ms for r in rows[m]]

    c_oos = _cells(test_rows, e_oos)
    cl_in, th_in, e_in = capacity_fit(shapes, prof, rows, cl_oos, th_oos,
                                      {k: float(np.mean(v)) for k, v in c_oos.items()}, training)
    c_in, c_art = _cells(all_rows, e_in), _cells(all_rows, e_art)
    in_test = [(r, e) for r, e in zip(all_rows, e_in) if r.name not in training[r.model]]
    c_in_test = _cells([r for r, _ in in_test], [e for _, e in in_test])
    c_art_test = _cells(test_rows, e_art_test)
    cells = []
    failures = []
    for m in MODELS:
        for fam in FAMILY_ORDER:
            for multi in (False, True):
                key = (m, fam, multi)
                if key not in c_in:
                    continue
                oos = _stat(c_oos.get(key, []))
                art = _stat(c_art[key])
                art_t = _stat(c_art_test.get(key, []))
                ins = _stat(c_in[key])
                artefact = ARTEFACT_CELLS.get(key, "")
                # Compared on the same held-out rows: the artifact's parameters were
                # fitted on its profiling runs, which are also (near-)copies of some
                # single-node placement rows.
                cell = {
                    "model": m, "family": fam, "nodes": "multi" if multi else "single",
                    "test": oos, "in_sample": ins, "artifact": art, "artifact_test": art_t,
                    "data_artefact": artefact,
                    "beats_artifact": None if oos is None else bool(oos["avg"] < art_t["avg"]),
                    # Same rows again: the in-sample fit's error on the held-out rows.
                    "in_sample_test_rows": _stat(c_in_test.get(key, [])),
                    "in_sample_above_test": None if oos is None else bool(np.mean(c_in_test[key]) > oos["avg"] + 1e-9),
                }
                if cell["beats_artifact"] is False:
                    cell["rows_vs_artifact"] = [
                        {"row": r.name, "measured_ms": round(r.iter_ms, 1), "ours_ms": round(float(po), 1),
                         "artifact_ms": round(float(pa), 1)}
                        for r, po, pa in zip(test_rows, pred_oos, pred_art)
                        if (r.model, family_of_label(r.label), r.multi_node) == key]
                if oos and not artefact and oos["avg"] > CELL_LIMIT:
                    failures.append(f"cell {m}/{fam}/{cell['nodes']} avg {100 * oos['avg']:.1f}% > {100 * CELL_LIMIT:.0f}%")
                cells.append(cell)

    def pooled(rs, es):
        s = [e for r, e in zip(rs, es) if not r.multi_node]
        mu = [e for r, e in zip(rs, es) if r.multi_node]
        return {"single": _stat(s), "multi": _stat(mu), "all": _stat(es)}

    pooled_oos = pooled(test_rows, e_oos)
    if pooled_oos["all"]["avg"] > POOLED_LIMIT:
        failures.append(f"pooled avg {100 * pooled_oos['all']['avg']:.1f}% > {100 * POOLED_LIMIT:.0f}%")
    unmarked = [e for r, e in zip(test_rows, e_oos)
                if (r.model, family_of_label(r.label), r.multi_node) not in ARTEFACT_CELLS]
    quirk_rows = sorted({f"{r.model}:{r.name} ({r.quirk})" for r in all_rows if r.quirk})
    return {
        "training_rows": training,
        "test_rows": len(test_rows),
        "pooled": {"test": pooled_oos, "test_without_artefact_cells": _stat(unmarked),
                   "in_sample": pooled(all_rows, e_in), "artifact": pooled(all_rows, e_art),
                   "artifact_test": pooled(test_rows, e_art_test)},
        "cells": cells,
        "cluster_test_fit": dict(zip(CLUSTER_NAMES, map(float, cl_oos))),
        "cluster_in_sample_fit": dict(zip(CLUSTER_NAMES, map(float, cl_in))),
        "params_test_fit": {m: dict(zip(PARAM_NAMES, map(float, th_oos[m]))) for m in MODELS},
        "data_artefacts": {"cells": {f"{k[0]}/{k[1]}/{'multi' if k[2] else 'single'}": v for k, v in ARTEFACT_CELLS.items()},
                           "reasons": ARTEFACT_REASONS, "evidence": _artefact_evidence(data_dir)},
        "quirks": {"rows": quirk_rows, "notes": QUIRKS},
        "feasibility": _feasibility_report(data_dir),
        "beats_artifact": {
            "cells": sum(1 for c in cells if c["beats_artifact"]),
            "of": sum(1 for c in cells if c["beats_artifact"] is not None),
            "not_beaten": [f"{c['model']}/{c['family']}/{c['nodes']}" for c in cells if c["beats_artifact"] is False],
        },
        "in_sample_above_test": [f"{c['model']}/{c['family']}/{c['nodes']}" for c in cells if c["in_sample_above_test"]],
        "failures": failures,
        "ok": not failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _fmt(s):
    return "-" if s is None else f"{100 * s['avg']:5.1f}/{100 * s['max']:5.1f} ({s['rows']:3d})"


def render_text(rep: dict) -> str:
    out = ["gearshift perfmodel validate: relative error of iteration time, avg%/max% (rows)", ""]
    out.append("training rows (besides the profiling runs):")
    for m, names in rep["training_rows"].items():
        out.append(f"  {m:8s} {', '.join(names)}")
    out.append("")
    out.append(f"{'model':8s} {'family':13s} {'nodes':6s} {'test (held out)':>22s} {'in-sample':>22s} "
               f"{'artifact, same rows':>22s} {'artifact, all rows':>22s}  note")
    for c in rep["cells"]:
        note = f"data artefact: {c['data_artefact']}" if c["data_artefact"] else ""
        if c["beats_artifact"] is False:
            note = (note + "; " if note else "") + "not better than artifact"
        out.append(f"{c['model']:8s} {c['family']:13s} {c['nodes']:6s} {_fmt(c['test']):>22s} "
                   f"{_fmt(c['in_sample']):>22s} {_fmt(c['artifact_test']):>22s} {_fmt(c['artifact']):>22s}  {note}")
    out.append("")
    for name in ("test", "in_sample", "artifact_test", "artifact"):
        p = rep["pooled"][name]
        out.append(f"pooled {name:13s} single {_fmt(p['single'])}  multi {_fmt(p['multi'])}  all {_fmt(p['all'])}")
    out.append(f"pooled test without artefact cells: {_fmt(rep['pooled']['test_without_artefact_cells'])}")
    out.append(f"cluster constants (held-out fit): " + ", ".join(f"{k}={v:.3g}" for k, v in rep["cluster_test_fit"].items()))
    ba = rep["beats_artifact"]
    out.append(f"better than the artifact's model (same held-out rows) in {ba['cells']} of {ba['of']} cells"
               + (f"; not in: {', '.join(ba['not_beaten'])}" if ba["not_beaten"] else ""))
    for c in rep["cells"]:
        if c["beats_artifact"] is False:
            out.append(f"  {c['model']}/{c['family']}/{c['nodes']} rows (measured / ours / artifact ms): "
                       + "; ".join(f"{x['row']} {x['measured_ms']}/{x['ours_ms']}/{x['artifact_ms']}"
                                   for x in c["rows_vs_artifact"]))
    above = rep["in_sample_above_test"]
    out.append(f"in-sample error above held-out (same rows) in {len(above)} cells"
               + (": " + ", ".join(f"{c['model']}/{c['family']}/{c['nodes']} {100 * c['in_sample_test_rows']['avg']:.1f}% "
                                   f"vs {100 * c['test']['avg']:.1f}%" for c in rep["cells"] if c["in_sample_above_test"])
                  if above else ""))
    out.append("")
    out.append("data artefacts:")
    for k, v in rep["data_artefacts"]["reasons"].items():
        out.append(f"  {k}: {v}")
    for lab, ev in rep["data_artefacts"]["evidence"].items():
        out.append(f"    vit {lab}: even 8-GPU {ev['even_8gpu_ms']}; uneven odd 8-GPU {ev['uneven_odd_8gpu_ms']}")
    out.append("data quirks handled:")
    for k, v in rep["quirks"]["notes"].items():
        out.append(f"  {k}: {v}")
    f = rep["feasibility"]
    out.append("memory feasibility (analytic):")
    out.append(f"  measured rows predicted infeasible: {len(f['measured_rows_predicted_infeasible'])} of {f['measured_rows']}"
               + (f" {f['measured_rows_predicted_infeasible']}" if f["measured_rows_predicted_infeasible"] else ""))
    out.append(f"  vs the artifact's tables ({f['compared_plans']} plans compared): allowed by the tables but ruled out "
               f"here: {len(f['artifact_allowed_we_rule_out'])} {f['artifact_allowed_we_rule_out']}; "
               f"allowed here but not by the tables: {f['we_allow_artifact_did_not']} "
               f"(e.g. {', '.join(f['we_allow_artifact_did_not_examples'][:6])})")
    out.append("")
    out.append("PASS" if rep["ok"] else "FAIL: " + "; ".join(rep["failures"]))
    out.append(f"({rep['seconds']} s)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gearshift perfmodel validate", description=__doc__.split("\n\n")[1])
    ap.add_argument("--data", default=str(DATA_DIR), help="Rubick data folder (default: the shipped copy)")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text")
    args = ap.parse_args(argv)
    rep = run(args.data)
    if args.output == "json":
        print(json.dumps(rep, indent=1))
    else:
        print(render_text(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# The rule applied to the shipped data (what `validate` prints, and what the
# shipped all-rows fit warm-starts from).
TRAINING_ROWS = {m: training_rows(m, load_profile(m), load_placements(m)) for m in MODELS}
