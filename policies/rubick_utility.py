"""Rubick's utility of one allocation of one job, restart included (issue 21 item 5).

The kernel (``rubick_kernels``) moves a job only to higher utility, so the utility
must never fall as the allocation gets faster. The earlier form,
``(thr/ref)^alpha x f / f1`` with ``f = T/(T+R)`` (T: the seconds left at this speed,
R: the restart), tends to ``(thr/ref)^(alpha-1)`` when the restart dominates (T << R)
and so falls as the job gets faster: short jobs started below their request and never
grew (``/work/shared/reference/baseline-fidelity.md``, "Why rubick loses on short
jobs"). Here the speed is what the job sees over the rest of its run, restart included:

- a pending job (it pays R whatever it gets, ``start_unavoidable``):
  ``((T1 + R) / (T + R))^alpha``, T1 = the seconds left at its request's speed;
- a running job moving to this allocation: ``(T1 / (T + R))^alpha``; staying where it
  is costs no restart: ``(T1 / T_stay)^alpha`` (``rubick_problem``'s stay column);
- R = 0: ``(thr / ref)^alpha``, the same as before.

All three are increasing in ``thr`` (T = left / thr falls), and for long jobs (T >> R)
they tend to the plain normalised speed ``(thr/ref)^alpha``, so what made the long
llama30 jobs fast (plan changes at high normalised throughput) is unchanged. R is each
job's own restart (``perfmodel.restart``) when the run charges per-job restarts.
"""

from __future__ import annotations

import numpy as np


def restart_speed_utility(thr: np.ndarray, refs: np.ndarray, left: np.ndarray, R: np.ndarray,
                          running: np.ndarray, alpha: float, start_unavoidable: bool) -> np.ndarray:
    """Utilities of a (jobs x candidates) ``thr`` table; ``refs``, ``left`` (samples),
    ``R`` (seconds) and ``running`` per job. 0 where ``thr`` is 0."""
    thr = np.asarray(thr, float)
    refs = np.asarray(refs, float)[:, None]
    left = np.asarray(left, float)[:, None]
    R = np.broadcast_to(np.asarray(R, float), (thr.shape[0],))[:, None]
    pending = ~np.asarray(running, bool)[:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        T = np.where(thr > 0, left / thr, np.inf)
        T1 = left / refs
        num = np.where(pending & start_unavoidable, T1 + R, T1)
        speed = np.where(R > 0, num / (T + R), thr / refs)
        u = np.where(thr > 0, speed, 0.0) ** alpha
    return u
