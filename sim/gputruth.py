"""Ground truth across GPU types: how much faster or slower a job really runs on a
type than on the reference GPU of the measured tables (the Rubick testbed's A800).

Never the belief's numbers (``perfmodel.gputypes`` rescales the fit term by term from
peak TFLOPS, memory bandwidth and link speed); instead, where it exists, measurement:

- ``a100``: the A800 is an A100 with NVLink cut from 600 to 400 GB/s; nothing measured
  separates them, so the same speed (1.0).
- ``v100``: A100 / V100 = the geometric mean over the batch sizes both tables hold of
  ElasticFlow's measured A100 ResNet-50 iterations/s on one GPU
  (``data/elasticflow-a100/resnet50.csv``) over Gavel's measured V100 ResNet-50 steps/s
  (``data/gavel/throughputs_isolated.csv``), the only model measured on both.
- ``p100``, ``k80``: V100's speed times Gavel's measured type / V100 ratio for the
  job's model class (geometric mean over the class's batch sizes, one GPU): Rubick's
  models (ViT, BERT, RoBERTa, T5, GPT-2, LLaMA) are transformers, Gavel's
  "Transformer" rows; a Gavel job uses its own job type's row (``gavel_speed``).
- ``h100``, ``h200``, ``t4`` (no measurement): the ratio of the type's memory
  bandwidth to the reference's, a published specification the belief does not use
  on its own.
Memory capacity is the type's (a hardware fact); whether a plan fits is judged by the
simulator's independent estimate (``sim.extended.memory_gb``), not the model's.
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path

DATA = Path(__file__).parent / "data"
MEASURED_TYPES = ("k80", "p100", "v100")
TRANSFORMER = "Transformer"


def job_class(model_name: str) -> str:
    """Gavel's job class for a model name (Rubick's models are all transformers)."""
    name = model_name.split(" (")[0]
    low = name.lower()
    for cls in ("ResNet-18", "ResNet-50", "Recommendation", "CycleGAN", "A3C", "LM", "Transformer"):
        if low == cls.lower() or low.startswith(cls.lower()):
            return cls
    return TRANSFORMER


@functools.lru_cache(maxsize=1)
def gavel_table() -> dict[tuple[str, int, str], float]:
    """(job_type, GPUs, worker type) -> measured steps/s (0 = did not run)."""
    out = {}
    with open(DATA / "gavel" / "throughputs_isolated.csv", newline="") as f:
        for r in csv.DictReader(f):
            out[(r["job_type"], int(r["scale_factor"]), r["worker_type"])] = float(r["steps_per_s"])
    return out


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


@functools.lru_cache(maxsize=1)
def a100_over_v100() -> float:
    """Measured A100 : V100 speed (ResNet-50, one GPU, same batch sizes)."""
    a100 = {}
    with open(DATA / "elasticflow-a100" / "resnet50.csv", newline="") as f:
        for r in csv.DictReader(f):
            a100[int(r["global_batch_size"])] = float(r["1"])
    g = gavel_table()
    ratios = [a100[b] / g[(f"ResNet-50 (batch size {b})", 1, "v100")]
              for b in a100 if g.get((f"ResNet-50 (batch size {b})", 1, "v100"), 0) > 0]
    return _geomean(ratios)


@functools.lru_cache(maxsize=64)
def over_v100(gpu_type: str, cls: str) -> float:
    """Measured speed of ``gpu_type`` / V100 for a job class (Gavel, one GPU)."""
    g = gavel_table()
    ratios = [t / g.get((jt, 1, "v100"), 0.0) for (jt, n, w), t in g.items()
              if w == gpu_type and n == 1 and job_class(jt) == cls and g.get((jt, 1, "v100"), 0) > 0]
    return _geomean(ratios)


def speed_factor(gpu_type: str, model_name: str) -> tuple[float, str]:
    """(speed on ``gpu_type`` / speed on the reference GPU, its source)."""
    if not gpu_type or gpu_type in ("a800", "a100"):
        return 1.0, "reference"
    if gpu_type in MEASURED_TYPES:
        v100 = 1.0 / a100_over_v100()
        if gpu_type == "v100":
            return v100, "measured-ratio"
        r = over_v100(gpu_type, job_class(model_name))
        if not math.isnan(r):
            return v100 * r, "measured-ratio"
    from gearshift.perfmodel.gputypes import REFERENCE, spec_of

    return spec_of(gpu_type).mem_bw_gbs / spec_of(REFERENCE).mem_bw_gbs, "spec-ratio"


def gavel_speed(job_type: str, gpus: int, gpu_type: str) -> float | None:
    """Gavel's measured steps/s of one of its job types on ``gpus`` GPUs of a type it
    measured (None where it has no row; 0 = it did not run there)."""
    return gavel_table().get((job_type, gpus, gpu_type))


SCALING_EXP = 0.8  # sim.truth's sub-linear speed-up, for GPU counts Gavel did not measure


def gavel_measured(job_type: str, gpus: int, gpu_type: str) -> float | None:
    """Gavel's steps/s of a job type on ``gpus`` GPUs of a measured type: its row, else
    the largest measured count below scaled by (GPUs ratio)^0.8; None: nothing measured.
    0 = it did not run there (out of memory)."""
    g = gavel_table()
    got = g.get((job_type, gpus, gpu_type))
    if got is not None:
        return got
    below = [n for (jt, n, w) in g if jt == job_type and w == gpu_type and n < gpus and g[(jt, n, w)] > 0]
    if not below:
        return None
    n = max(below)
    return g[(job_type, n, gpu_type)] * (gpus / n) ** SCALING_EXP


def gavel_request_speed(job_type: str, gpus: int) -> float | None:
    """A Gavel job's steps/s on the reference GPU: measured V100 x measured A100 : V100."""
    v = gavel_measured(job_type, gpus, "v100")
    return v * a100_over_v100() if v else None


def memory_gb(gpu_type: str) -> float:
    from gearshift.perfmodel.gputypes import spec_of

    return spec_of(gpu_type).mem_gb
