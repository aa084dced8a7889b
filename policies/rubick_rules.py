"""Rubick's rules (``rubick.py``), kept here: what preempting a running job costs
it, how long a pending guarantee waits for pinned jobs, when a best-effort job
goes before pending guarantees and how it is kept then, the order of the
pending seeds, and how far a best-effort job may be shrunk.

**Resume charge** (``resume_charge``, on). Rubick charges a restart to the
allocation that causes it: a running job's change of plan or placement is
scaled by T/(T+R) (T = time left at that speed, R = restart cost), and a
pending job's start by the same factor relative to its request's
(``start_unavoidable``: a pending job pays R once whenever it starts).
Preempting a running job was free, yet the job pays R again when it resumes.
A pending one-step job (start unavoidable, and no slower for running below
its request when the restart dominates) could therefore displace a job a few
steps from done, which then restarted for those steps: on rubick-mt's llama30
tail (R ~ 530 s) four such preemptions added restarts to the jobs that
finish last. Now every utility of a running job (staying, or any other
allocation) is divided by its request's T1/(T1+R) (T1 = time left at the
request's predicted speed), the factor a pending job's start is measured
against: running and pending jobs are on one scale ("throughput over the
rest of the run, relative to the request's including one start"), and a
running job competes as if the start it would have to repeat were paid. Its
own choices (stay, grow, shrink, switch) keep their order; a job with hours
left is barely affected (factor 1 + R/T1); one minutes from done is not
displaced for a job of equal normalised gain.

**Bounded guarantee wait** (``guarantee_wait_bound``, off by default). Pending guaranteed
jobs are seeded after pinned best-effort jobs (those (re)started less than
``min_run_time`` ago), so that evicting a fresh start does not cost it two
restarts in one window; the intent was that a guarantee waits at most
``min_run_time`` for them. But best-effort jobs that keep growing and
shrinking are pinned anew at every switch, so a guarantee needing whole
nodes (rubick-mt's 40- and 48-GPU llama30 jobs) waited for hours while small
jobs were spread over every node. A pending guaranteed job that has waited
``min_run_time`` or longer is now seeded before pinned best-effort jobs (as
with ``guarantee_evicts``); younger ones still wait behind them.

It is off by default. On rubick-mt (measured) it raises rubick's makespan
lead from 1.0026x to 1.059x, but in the extended regime, where the learning
oracle's OOM rule (``memory_rule.py``) leaves many llama30 best-effort jobs on
small plans spread over every node, the guarantees it seeds first preempt
them far more often (83 preemptions against 33 on rubick-mt extended) and
rubick's average-JCT lead there falls from 1.75x to 1.43x, below issue 10's
1.5x floor. Both numbers are in ``docs/evaluation.md``'s rubick-mt ablations.

**Starved best-effort jobs join the guarantee queue** (``starved_seed``, 1). Pending
guarantees are seeded before every best-effort job that is not pinned, so on
rubick-mt, where 40- and 48-GPU llama30 guarantees follow one another all day,
best-effort llama30 jobs with minutes of work (their run is mostly the ~530 s
restart) queued ~7.8 h on average against ~1.4 h under synergy-srtf, and rubick's
average JCT was 0.59x the best baseline's. While a guarantee is pending, a
best-effort job that has never started and has waited at least ``starved_seed``
times its own predicted run (at the request, restart included: a slowdown of 2,
as highest-response-ratio-next reasons) now joins the pending guarantees, the
merged queue shortest predicted run first, and is seeded at its cheapest allowed
candidate. Only jobs that never started: letting a preempted job back in this
way made jobs displace each other (one llama7 job restarted 19 times). With no
guarantee pending nothing changes (on rubick-base, applied always, it cost 1.55x
-> 1.47x). The factor is the principled 1; 0.5, 2, 4 and 8 gave 1.05x, 1.14x,
1.07x and 1.14x on rubick-mt (measured) before the never-started condition: noisy,
so not tuned. ``docs/evaluation.md`` has the ablation.

**Starved jobs are kept** (``keep_starved``, on). A starved best-effort job admitted
this way was an ordinary running best-effort job from the next round: once its pin
ended, the next guarantee's seed evicted it (a llama30 restart is ~530 s of the 600 s
pin, so it had barely started), and having started once it never counted as starved
again. On rubick-mt two such llama30 jobs (1,275 s and 163 s of work) finished at
79,398 s and 77,916 s, the run's last, 12 h after they came. Now it is seeded where it
runs, with the running guarantees, until it ends.

**The queue goes by GPU-time** (``queue_key="area"``). Pending seeds (guarantees and
starved jobs) were ordered by their predicted run at the request alone, so a 40-GPU
llama30 guarantee with 5 s of work and a 530 s restart went before a 2-GPU bert one
with 10 minutes; the first holds 40 x 535 = 21,400 GPU-seconds, the second 1,230.
Smith's rule for jobs that use several of the machines at once orders them by
GPU-time, GPUs x (run + restart) (``queue_keys``; "time" keeps the old order).

**A best-effort job is not shrunk to where it wastes GPUs** (``min_efficiency``, 0.9).
Its candidates below its request are allowed only where finishing there needs at most
1/0.9 times the GPU-time of its request, restart included (so a short job, whose
restart dominates, may still run on a few GPUs). The utility's exponent (0.5) makes a
job's first GPUs worth the most, so a 16-GPU llama7 job ran on 1 GPU with offload at
1% of its request's speed (6x the GPU-time) and was switched between 1, 2 and 4 GPUs
every 10 minutes: 16 restarts, 15,600 s for 2,100 s of work.

All use only what the live system knows: declared steps (or learned,
``rubick_declared``), the belief's throughput, the restart cost the policy charges,
and times.
"""

from __future__ import annotations

import numpy as np


def resume_weights(running: np.ndarray, seconds_left_at_request: np.ndarray, restart_cost) -> np.ndarray:
    """Per job: (T1 + R) / T1 for a running job, 1 for a pending one (R: one cost, or one per job)."""
    t1 = np.maximum(np.asarray(seconds_left_at_request, float), 1e-9)
    R = np.broadcast_to(np.asarray(restart_cost, float), t1.shape)
    return np.where(np.asarray(running, bool) & (R > 0), (t1 + R) / t1, 1.0)


def seed_groups(groups: list[list[int]], waited: list[float], min_run_time: float, *, evicts: bool,
               bound: bool) -> list[list[int]]:
    """Seed groups in order. ``groups`` = [pinned guaranteed, running guaranteed,
    pending guaranteed, pinned best-effort]; ``waited[i]`` = seconds job i has
    waited. Pending guarantees go before pinned best-effort jobs when ``evicts``,
    or (``bound``) once they have waited ``min_run_time``."""
    pinned_g, running_g, pending_g, pinned_be = groups
    if evicts:
        return [pinned_g, running_g, pending_g, pinned_be]
    if not bound:
        return [pinned_g, running_g, pinned_be, pending_g]
    over = [i for i in pending_g if waited[i] >= min_run_time]
    young = [i for i in pending_g if waited[i] < min_run_time]
    return [pinned_g, running_g, over, pinned_be, young]


def queue_keys(how: str, left, speed, restarts, gpus) -> np.ndarray:
    """Per job, its place in the queue of pending seeds: ``time``, the predicted run at
    the request's (target's) speed; ``run``, with its restart; ``area``, that times its GPUs."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.asarray(left, float) / np.maximum(np.asarray(speed, float), 1e-9)
    if how == "time":
        return t
    t = t + np.asarray(restarts, float)
    return t if how == "run" else t * np.asarray(gpus, float)


def starved_first(g2: np.ndarray, guar, stay, held, valid, left, targets, refs, restarts, waited, jobs, factor=1.0,
                  qkey=None):
    """Pending guarantees merged, shortest predicted run first, with the pending best-effort
    jobs that have waited at least their own predicted run (at the request, restart
    included): those are seeded too, at their cheapest allowed candidate that fits.
    Returns the merged seed group and the new ``seed_any``."""
    fresh = np.array([j.started_at is None for j in jobs], bool)  # never started: no ping-pong
    be = np.flatnonzero(~guar & (stay < 0) & ~held & valid.any(axis=1) & fresh)
    with np.errstate(divide="ignore", invalid="ignore"):
        run = left[be] / np.maximum(refs[be], 1e-9) + restarts[be]
    run = run * factor
    starved = be[waited[be] >= run]
    if not len(starved):
        return g2, guar.copy()
    key = {int(i): (left[i] / max(targets[i], 1e-9) if qkey is None else qkey[i], jobs[i].submitted_at, jobs[i].job_id)
           for i in g2.tolist()}
    for i, r in zip(be.tolist(), run.tolist()):
        if waited[i] >= r:
            key[i] = (r if qkey is None else qkey[i], jobs[i].submitted_at, jobs[i].job_id)
    merged = np.array(sorted(key, key=key.__getitem__), np.int64)
    seed_any = guar.copy()
    seed_any[starved] = True
    return merged, seed_any
