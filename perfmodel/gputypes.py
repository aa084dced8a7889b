"""Per-GPU-type parameters of the performance model (pure).

The fitted parameters (``perfmodel.catalog``) describe the Rubick testbed's GPU, the
A800-SXM4-80GB (``REFERENCE``). For another type, ``params_for_type`` rescales them
from the vendors' published specifications (``SPECS``; sources in
``perfmodel/GPU_TYPES.md``):

- per-sample compute (``t_fwd``, ``c_fwd``, ``t_3d``, ``c_mb3d``): the kernels of a
  training step are a mix of matrix multiplies (bound by peak dense FP16/BF16 tensor
  throughput) and element-wise / normalisation / attention-softmax work (bound by
  memory bandwidth); the time scales by the geometric mean of the two ratios;
- the GPU optimizer step (``k_opt``, streaming the fp32 state): memory bandwidth;
- intra-node collectives (``bw_nvlink``): the type's GPU-to-GPU link (NVLink, or
  PCIe where a type has none), capped at the fit's bound;
- memory capacity (``gpu_mem_gb``): feasibility, i.e. which plans run out of memory.
CPU-side terms (offload, constants) and the network between nodes are the node's,
not the GPU's, and stay as fitted. ``""`` (an untyped node) is the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gearshift.perfmodel.model import C_INDEX, P_INDEX, PerfParams


@dataclass(frozen=True)
class GpuSpec:
    name: str
    tflops: float  # peak dense FP16/BF16 tensor TFLOPS (FP32 where the GPU has no tensor cores)
    mem_bw_gbs: float  # HBM / GDDR bandwidth, GB/s
    link_gbs: float  # GPU-to-GPU bandwidth inside a node (NVLink total, else PCIe x16), GB/s
    mem_gb: float  # memory per GPU, GB
    source: str = ""


# Vendors' datasheets (SXM parts where both exist; per GPU for the dual-GPU K80).
SPECS: dict[str, GpuSpec] = {s.name: s for s in (
    GpuSpec("h200", 989.0, 4800.0, 900.0, 141.0, "NVIDIA H200 datasheet"),
    GpuSpec("h100", 989.0, 3350.0, 900.0, 80.0, "NVIDIA H100 SXM5 datasheet"),
    GpuSpec("a800", 312.0, 2039.0, 400.0, 80.0, "NVIDIA A800 SXM4 80GB datasheet"),
    GpuSpec("a100", 312.0, 2039.0, 600.0, 80.0, "NVIDIA A100 SXM4 80GB datasheet"),
    GpuSpec("v100", 125.0, 900.0, 300.0, 32.0, "NVIDIA V100 SXM2 32GB datasheet"),
    GpuSpec("p100", 21.2, 732.0, 160.0, 16.0, "NVIDIA P100 SXM2 16GB datasheet (FP16, no tensor cores)"),
    GpuSpec("t4", 65.0, 320.0, 16.0, 16.0, "NVIDIA T4 datasheet (PCIe gen3 x16)"),
    GpuSpec("k80", 4.37, 240.0, 16.0, 12.0, "NVIDIA Tesla K80 datasheet, per GK210 GPU (FP32, PCIe gen3 x16)"),
)}
REFERENCE = "a800"  # the GPU of the measurements the shipped fit comes from


def spec_of(gpu_type: str) -> GpuSpec:
    """The type's specification; "" or an unknown name is the reference type."""
    return SPECS.get(gpu_type or REFERENCE, SPECS[REFERENCE])


def compute_slowdown(gpu_type: str) -> float:
    """How much longer per-sample compute takes than on the reference (> 1 = slower)."""
    ref, s = SPECS[REFERENCE], spec_of(gpu_type)
    return float(np.sqrt((ref.tflops / s.tflops) * (ref.mem_bw_gbs / s.mem_bw_gbs)))


_COMPUTE = ("t_fwd", "c_fwd", "t_3d", "c_mb3d")


def params_for_type(params: PerfParams, gpu_type: str) -> PerfParams:
    """``params`` (fitted on the reference GPU) moved to ``gpu_type``."""
    if not gpu_type or gpu_type == REFERENCE or gpu_type not in SPECS:
        return params
    return _scaled(params, gpu_type)


@functools.lru_cache(maxsize=4096)
def _scaled_cached(key: tuple, theta: tuple, cluster: tuple, gpu_type: str) -> PerfParams:
    ref, s = SPECS[REFERENCE], SPECS[gpu_type]
    th = np.array(theta, dtype=np.float64)
    for name in _COMPUTE:
        th[P_INDEX[name]] *= compute_slowdown(gpu_type)
    th[P_INDEX["k_opt"]] *= ref.mem_bw_gbs / s.mem_bw_gbs
    cl = np.array(cluster, dtype=np.float64)
    cl[C_INDEX["bw_nvlink"]] *= s.link_gbs / ref.link_gbs
    return PerfParams(key[0], th, cl, s.mem_gb)


def _scaled(params: PerfParams, gpu_type: str) -> PerfParams:
    return _scaled_cached((params.model_key,), tuple(np.asarray(params.theta).tolist()),
                          tuple(np.asarray(params.cluster).tolist()), gpu_type)
