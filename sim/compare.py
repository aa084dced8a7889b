"""rubick against the best baseline, row by row (issue 21 item 7): the ratio of
averages, of medians, the per-job geometric mean, per model class, and the makespan.

Every ratio is the best baseline's figure over the policy's (> 1: the policy is
better). The best baseline is the one of lowest average JCT among the baselines run
(policies not named ``rubick*``) that finished every job. A job's model class is its
id up to the last ``-`` (``llama30-12`` -> ``llama30``), else its model's name.
"""

from __future__ import annotations

import math
import statistics

from gearshift.sim.engine import SimResult
from gearshift.sim.metrics import _tracked


def job_jcts(res: SimResult) -> dict[str, float]:
    """Each finished tracked job's JCT (s)."""
    return {r.job.job_id: r.finish - r.job.submit for r in _tracked(res) if r.finish is not None}


def geomean_ratio(base: dict[str, float], mine: dict[str, float]) -> float:
    """The per-job geometric mean of ``base``'s JCT over ``mine`` (> 1: ``mine`` faster), over
    the jobs both finished; nan when there are none."""
    common = [j for j in mine if j in base and mine[j] > 0 and base[j] > 0]
    return math.exp(statistics.mean(math.log(base[j] / mine[j]) for j in common)) if common else math.nan


def model_class(rec) -> str:
    jid = rec.job.job_id
    return jid.rsplit("-", 1)[0] if "-" in jid else rec.job.spec.model.name


def compare(results: list[SimResult], summaries: list[dict]) -> dict:
    by = {s["policy"]: (r, s) for r, s in zip(results, summaries)}
    base = [p for p, (_, s) in by.items() if not p.startswith("rubick") and s["unfinished"] == 0
            and not math.isnan(s["avg_jct_s"])]
    if not base:
        return {}
    best = min(base, key=lambda p: by[p][1]["avg_jct_s"])
    bres, bsum = by[best]
    bj = job_jcts(bres)
    classes = {r.job.job_id: model_class(r) for r in bres.records}
    out = {}
    for p, (res, s) in by.items():
        if p == best or s["unfinished"]:
            continue
        pj = job_jcts(res)
        common = [j for j in pj if j in bj and pj[j] > 0 and bj[j] > 0]
        per_model: dict[str, dict] = {}
        for m in sorted({classes.get(j, "") for j in common}):
            js = [j for j in common if classes.get(j, "") == m]
            a, b = statistics.mean(pj[j] for j in js), statistics.mean(bj[j] for j in js)
            per_model[m] = {"jobs": len(js), "avg_jct_s": a, "best_avg_jct_s": b, "ratio": b / a if a else math.nan}
        out[p] = {
            "best_baseline": best,
            "avg_jct_ratio": bsum["avg_jct_s"] / s["avg_jct_s"] if s["avg_jct_s"] else math.nan,
            "median_jct_ratio": bsum["median_jct_s"] / s["median_jct_s"] if s["median_jct_s"] else math.nan,
            "per_job_geomean_ratio": geomean_ratio(bj, pj),
            "jobs_faster": sum(pj[j] < bj[j] for j in common),
            "jobs_compared": len(common),
            "makespan_ratio": bsum["makespan_s"] / s["makespan_s"] if s["makespan_s"] else math.nan,
            "per_model": per_model,
            "worst_model_ratio": min((v["ratio"] for v in per_model.values()), default=math.nan),
        }
    return out
