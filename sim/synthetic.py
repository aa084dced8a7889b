"""A synthetic workload generator for sweeps.

Jobs are drawn from *templates*: the (model, GPUs, plan, seconds per step) tuples that
occur in the Rubick base workload, so every synthetic job's requested configuration
was really measured. The generator then chooses, from its own seeded RNG:
arrivals (Poisson at ``rate_per_hour``), the template (weighted by ``size_mix`` over GPU
counts and ``model_mix`` over models), the run time at the requested configuration
(log-uniform between ``min_hours`` and ``max_hours``; steps = run time / step time) and
whether the job is guaranteed (``guaranteed_fraction``).
"""

from __future__ import annotations

import math
import random

from msgspec.structs import replace

from gearshift.sim.trace import Trace, TraceJob, parse_cluster


def parse_options(text: str) -> dict:
    """``"jobs=200,rate=30,guaranteed=0.5,sizes=1:4/8:1,models=gpt2:1/bert:2"``."""
    out: dict = {}
    keys = {"jobs": ("jobs", int), "rate": ("rate_per_hour", float), "guaranteed": ("guaranteed_fraction", float),
            "min_hours": ("min_hours", float), "max_hours": ("max_hours", float), "cluster": ("cluster", str)}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        if k in ("sizes", "models"):
            mix = {}
            for item in v.split("/"):
                a, _, w = item.partition(":")
                mix[int(a) if k == "sizes" else a] = float(w or 1)
            out["size_mix" if k == "sizes" else "model_mix"] = mix
        elif k in keys:
            name, conv = keys[k]
            out[name] = conv(v)
        else:
            raise ValueError(f"synthetic option {k!r} unknown; known: {', '.join(list(keys) + ['sizes', 'models'])}")
    return out


def synthetic_trace(
    jobs: int = 200,
    rate_per_hour: float = 30.0,
    size_mix: dict[int, float] | None = None,
    model_mix: dict[str, float] | None = None,
    guaranteed_fraction: float = 0.0,
    min_hours: float = 0.1,
    max_hours: float = 4.0,
    cluster: str = "8x8",
    seed: int = 0,
) -> Trace:
    from gearshift.sim.loaders import load_named

    if jobs < 1 or rate_per_hour <= 0 or not 0 <= guaranteed_fraction <= 1 or not 0 < min_hours <= max_hours:
        raise ValueError("synthetic: need jobs >= 1, rate > 0, 0 <= guaranteed <= 1, 0 < min_hours <= max_hours")
    templates = load_named("rubick-base").jobs
    weights = []
    for t in templates:
        w = 1.0
        if size_mix is not None:
            w *= size_mix.get(t.spec.gpus, 0.0)
        if model_mix is not None:
            w *= model_mix.get(t.truth_key, 0.0)
        weights.append(w)
    if not any(weights):
        raise ValueError("synthetic: no Rubick template matches the size/model mix")
    rng = random.Random(seed)
    now = 0.0
    out = []
    for i in range(jobs):
        now += rng.expovariate(rate_per_hour / 3600.0)
        t = rng.choices(templates, weights)[0]
        hours = min_hours * (max_hours / min_hours) ** rng.random()
        steps = max(1, round(hours * 3600 / t.spec.step_time))
        jid = f"s{i}-{t.truth_key}"
        spec = replace(t.spec, name=jid, steps=steps, guaranteed=rng.random() < guaranteed_fraction)
        out.append(TraceJob(jid, round(now, 3), spec, t.truth_key))
    return Trace(f"synthetic-s{seed}", out, parse_cluster(cluster),
                 note=f"synthetic: {jobs} jobs at {rate_per_hour}/h, guaranteed {guaranteed_fraction:.0%}")
