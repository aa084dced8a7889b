"""The rules of Sia's simulator (SOSP'23 artifact, ``siasosp23/artifacts`` at commit
37c68be, ``sia-simulator/``) that ``policies.sia`` and ``policies.sia_hetero`` share.
Each function names the code it follows; none of that code is copied.

- ``normalised``: ``sia.py`` ``SiaPolicy.optimize_mip``, the block under "# normalize
  all goodput values to min_goodput": a job's goodput row is divided by its smallest
  goodput over all GPU types and multiplied by the scale unit (GPUs per replica) of the
  configuration that has it ("# ensure that min value in row == valid scale unit"). A
  rigid job (one configuration per type) is normalised so that its goodput on the
  slowest type equals its GPU count (``_compute_rigid_job_goodput_single``, "# normalize
  and scale goodputs so that slowest cluster has goodput = ngpus"). Both give a job's
  smallest configuration a worth of its GPU count, so a 48-GPU job's only option is
  worth 48 GPUs, not one.
- ``realloc_factor``: ``optimize_mip``, "# re-alloc/migrate factor" with
  ``sia_use_pollux_realloc_factor = True`` (``simulator_config.py``): max(age -
  restarts x R, 0) / (age + R), R = the job's own restart penalty
  (``get_restart_penalty(jobname)``, measured per model in Sia; here
  ``perfmodel.restart`` per job when the run charges per-job restarts), and 1 while
  the job is younger than R ("# Don't penalize jobs that have not scaled up even once").
  ``__solve_mip_rescaled`` scales every configuration but the previous one by it.
- ``restoring``: the hard constraint "# do not re-allocate a job if it is currently
  doing a checkpoint-restore operation" (``optimize_mip``; ``scaling_underway`` =
  ``job.rescale_time > 0`` in ``multi_simulator.py``, on by ``preserve_ckpt_allocs =
  True``): a job whose last (re)start began less than its own restart ago keeps its
  allocation, and its re-allocation factor is 1.
- ``utility``: ``__power_up_speedup_matrix``: normalised goodput ^ p, rounded to two
  decimals, clipped at ``sia_goodput_clip_val = 3000``. The objective is sum of the
  chosen utilities + lambda_n x (jobs - allocations), minimised for p < 0. Sia defines
  ``opt_lambda_alloc_change`` from lambda_a but never adds it to the objective, so no
  allocation-change term is charged here either.
"""

from __future__ import annotations

from typing import Any, Callable

CLIP = 3000.0  # simulator_config.py: sia_goodput_clip_val


def restart_of(job, restart_cost: float, restart_model: Callable[[Any], float] | None) -> float:
    """The job's own restart: the per-job model when the run has one, else the flat cost."""
    return float(restart_model(job.spec)) if restart_model is not None else float(restart_cost)


def restoring(job, now: float, restart: float) -> bool:
    """Still in checkpoint-restore: its current allocation began less than its restart ago."""
    return job.running and job.switched_at is not None and now - job.switched_at < restart


def realloc_factor(age: float, restarts: int, restart: float) -> float:
    if restart <= 0 or age < restart:
        return 1.0
    return max(age - restarts * restart, 0.0) / (age + restart)


def normalised(goodputs: list[float], units: list[int], gpus: list[int]) -> list[float]:
    """Sia's normalised goodput of each configuration of one job (all types together).

    ``units[k]``: GPUs per replica of configuration k, ``gpus[k]``: its GPU count. One
    configuration per type (a rigid job): the slowest is worth its GPU count."""
    if not goodputs:
        return []
    lo = min(range(len(goodputs)), key=lambda k: goodputs[k])
    base = goodputs[lo]
    if base <= 0:
        return [0.0] * len(goodputs)
    rigid = len(set(gpus)) == 1
    scale = (gpus[lo] if rigid else units[lo]) / base
    return [g * scale for g in goodputs]


def utility(norm: float, factor: float, p: float) -> float:
    eff = norm * max(factor, 0.0)
    if eff <= 0:
        return CLIP
    return min(round(eff ** p, 2), CLIP)
