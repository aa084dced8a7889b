"""Declared steps as an upper bound (issue 21 item 4, ``--declared-noise K``).

In the traces a job's declared steps equal the steps it really runs. Users do not know
that: they declare a budget and the job stops earlier (converged, early-stopped). With
``K > 1`` each job declares ``true x F`` steps, F log-uniform in [1, K), drawn from the
run's seed and the job's id (the same for every policy). Policies see only the
declaration (``JobView.spec.steps``, ``remaining_steps``); the simulator finishes the
job at its true steps. Baselines that use remaining work (SRTF orders) read the same
declared figure.
"""

from __future__ import annotations

import math
import random

from msgspec.structs import replace


def declared_factor(k: float, seed: int, job_id: str) -> float:
    if k <= 1.0:
        return 1.0
    rng = random.Random(f"declared-noise:{seed}:{job_id}")
    return math.exp(rng.uniform(0.0, math.log(k)))


def declared_spec(spec, k: float, seed: int, job_id: str):
    """The spec a policy sees: steps = ceil(true x factor) (never below the truth)."""
    f = declared_factor(k, seed, job_id)
    if f == 1.0:
        return spec
    return replace(spec, steps=max(int(spec.steps), math.ceil(spec.steps * f)))
