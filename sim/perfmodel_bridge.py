"""Connects the simulator to the fitted performance model, if ``perfmodel`` provides one.

The simulator needs one function: ``predictor(spec, plan, gpus_per_node) -> seconds per
step`` (0 = the plan does not fit). It is used for ground truth where nothing was
measured (times noise) and, as the belief, for the policies. When ``perfmodel`` has no
usable API yet, ``find_predictor`` returns None and the simulator falls back to the
documented scaling rule (``sim.truth``).
"""

from __future__ import annotations

from gearshift.sim.truth import Predictor


def find_predictor(gpus_per_node: int, fit: str = "belief") -> Predictor | None:
    """``fit="belief"``: fitted on profiling runs only (what policies get);
    ``"in_sample"``: fitted on every measured row (the extended truth's source)."""
    try:
        from gearshift import perfmodel
    except Exception:
        return None
    make = getattr(perfmodel, "sim_predictor", None)
    if callable(make):
        return make(gpus_per_node=gpus_per_node, fit=fit)
    return None
