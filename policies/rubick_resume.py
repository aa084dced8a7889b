"""Rubick: what preempting a running job costs it (``resume_charge``).

Rubick's utilities (``rubick.py``) charge a restart to the allocation that
causes it: a running job's change of plan or placement is scaled by
T/(T+R) (T = time left at that speed, R = restart cost), and a pending
job's start by the same factor relative to its request's
(``start_unavoidable``: every pending job pays R once whenever it starts).
Keeping a running job costs nothing, so far so right. But preempting it
is not free either: the job pays R again when it resumes, and nothing in
the round charged that. A pending job (its start counted as unavoidable)
could therefore displace a running job that was seconds from done, which
then restarted for the few steps it had left: on rubick-mt's llama30 tail
(R ~ 530 s) four such preemptions added four restarts to the jobs that
finish last.

The charge: every utility of a running job (staying, or any other
allocation) is divided by its request's T1/(T1+R) (T1 = time left at the
request's predicted speed), the factor a pending job's start is measured
against. Utilities of running and pending jobs are then on one scale,
"throughput over the rest of the run, relative to the request's including
one start": a running job that stops must start again, so it competes as
if that start were already paid. The job's own choices (stay, grow,
shrink, switch) keep their order, since all are scaled alike; only the
competition between jobs changes. A job with hours left is barely
affected (factor ~1 + R/T1); one a few steps from done is never displaced
for a job of equal normalised gain. Guarantees are unaffected: pending
guaranteed jobs are seeded before the greedy search.

Only the belief is used (remaining steps declared by the job, predicted
throughput of its request, the restart cost the policy charges).
"""

from __future__ import annotations

import numpy as np


def resume_weights(running: np.ndarray, seconds_left_at_request: np.ndarray, restart_cost: float) -> np.ndarray:
    """Per job: (T1 + R) / T1 for a running job, 1 for a pending one."""
    t1 = np.maximum(np.asarray(seconds_left_at_request, float), 1e-9)
    out = np.ones(len(t1))
    if restart_cost > 0:
        out = np.where(np.asarray(running, bool), (t1 + restart_cost) / t1, 1.0)
    return out
