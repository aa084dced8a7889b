"""Analytic GPU-memory estimate per plan (no hand tables).

Model states (mixed-precision Adam, 16 bytes per parameter in all):
  fp16 weights 2, fp16 grads 2, fp32 master + momentum + variance 12.
ZeRO partitions them over the dp replicas: stage 1 the 12 optimizer bytes,
stage 2 also the grads, stage 3 also the weights.  ZeRO-Offload keeps the
optimizer state on the CPU and streams grads out through a bucket.
TP and PP divide the parameters over tp * pp GPUs.

Activations per transformer layer and micro-batch sample follow Korthikanti
et al. (2022): s*h*(10 + 24/tp) bytes for the linear/norm parts plus the
attention scores 5*a*s^2/tp unless the kernel is memory-efficient (flash
attention; assumed, because every measured LLaMA/GPT plan needs it to fit).
With activation checkpointing only each layer's input (2*s*h bytes) is kept,
plus one layer's full activations during recompute.  A pipeline stage keeps up
to min(pp, micro-batches) micro-batches in flight (1F1B), of L/pp layers.
A fixed reserve covers the CUDA context, NCCL buffers and allocator slack.
"""

from __future__ import annotations

import numpy as np

from gearshift.perfmodel.plans import PlanArray
from gearshift.perfmodel.shapes import ModelShape

GIB = 1024.0**3
# CUDA context + NCCL/communication buckets + fragmentation slack.
RESERVE_GB = 3.0
# DeepSpeed's default reduce/all-gather bucket (5e8 elements, fp16).
BUCKET_GB = 1.0
FLASH_ATTENTION = True


def model_state_parts(shape: ModelShape, plans: PlanArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per GPU (bytes): fp16 weights, fp16 grads, optimizer state (fp32 master + Adam)."""
    P = shape.params_m * 1e6 / (plans.tp * plans.pp)
    dp = plans.dp.astype(np.float64)
    z = plans.zero
    w = np.where(z >= 3, 2.0 * P / dp, 2.0 * P)
    g = np.where(z >= 2, 2.0 * P / dp, 2.0 * P)
    opt = np.where(z >= 1, 12.0 * P / dp, 12.0 * P)
    opt = np.where(plans.offload, 0.0, opt)
    # Offloaded grads leave the GPU through a bucket rather than being kept.
    g = np.where(plans.offload, np.minimum(g, BUCKET_GB * GIB), g)
    # ZeRO-3 gathers one layer's full weights at a time.
    w = w + np.where(z >= 3, 2.0 * shape.params_m * 1e6 / shape.layers, 0.0)
    return w, g, opt


def model_state_bytes(shape: ModelShape, plans: PlanArray) -> np.ndarray:
    w, g, opt = model_state_parts(shape, plans)
    return w + g + opt


def activation_bytes(shape: ModelShape, plans: PlanArray) -> np.ndarray:
    s, h, L = float(shape.seq_len), float(shape.hidden), float(shape.layers)
    a = float(shape.n_heads)
    tp = plans.tp.astype(np.float64)
    pp = plans.pp.astype(np.float64)
    mb = plans.micro_batch.astype(np.float64)
    per_layer = s * h * (10.0 + 24.0 / tp)
    if not FLASH_ATTENTION:
        per_layer = per_layer + 5.0 * a * s * s / tp
    per_layer = per_layer * mb
    layers_here = np.ceil(L / pp)
    in_flight = np.minimum(pp, plans.ga.astype(np.float64))
    full = per_layer * layers_here * in_flight
    ckpt = 2.0 * s * h * mb * layers_here * in_flight + per_layer
    return np.where(plans.grad_ckpt, ckpt, full)


def memory_per_gpu_gb(shape: ModelShape, plans: PlanArray) -> np.ndarray:
    """Estimated peak GPU memory per GPU (GiB) for each plan."""
    return (model_state_bytes(shape, plans) + activation_bytes(shape, plans)) / GIB + RESERVE_GB


def memory_feasible(shape: ModelShape, plans: PlanArray, gpu_mem_gb: float = 80.0) -> np.ndarray:
    return memory_per_gpu_gb(shape, plans) <= gpu_mem_gb


def memory_parts_gb(shape: ModelShape, plans: PlanArray) -> np.ndarray:
    """Per GPU (GiB), one row per plan: weights, grads, optimizer state, activations
    (the fixed reserve is in none). What a configuration needs grows part by part:
    fewer ZeRO/tp/pp shards or no offload grow the states, a larger micro-batch, no
    checkpointing or more micro-batches in flight grow the activations."""
    w, g, opt = model_state_parts(shape, plans)
    return np.stack([w, g, opt, activation_bytes(shape, plans)], axis=1) / GIB
