"""GPU types: the names jobs, nodes and the performance model use (pure).

A node's type comes from NVML's device name (``nvmlDeviceGetName``), normalised by
``gpu_type_of``: "NVIDIA A100-SXM4-80GB" -> "a100", "Tesla V100-SXM2-32GB" -> "v100",
"NVIDIA H100 80GB HBM3" -> "h100", a MIG instance -> its parent's type. A name no
rule knows becomes "" (untyped: the model treats it as the reference type, and only
jobs that accept any type land there). ``perfmodel.gputypes`` holds each type's
published specifications.
"""

from __future__ import annotations

import re
from functools import lru_cache

# Known types, newest first. Order matters for matching: "a100" before "a10".
GPU_TYPES: tuple[str, ...] = ("h200", "h100", "a800", "a100", "v100", "p100", "t4", "k80")

_RULES = tuple((t, re.compile(rf"(?<![a-z0-9]){t}(?![0-9])")) for t in GPU_TYPES)


@lru_cache(maxsize=1024)  # a handful of names, asked for on every heartbeat of every GPU
def gpu_type_of(device_name: str) -> str:
    """The normalised type of an NVML device name ("" when no rule matches)."""
    text = (device_name or "").lower()
    for t, rule in _RULES:
        if rule.search(text):
            return t
    return ""


def check_gpu_types(types, field: str = "gpu_types") -> str | None:
    """None when every entry is a known type, listed once; else the error text."""
    seen: set[str] = set()
    for i, t in enumerate(types):
        if t not in GPU_TYPES:
            return f"{field}[{i}]: unknown GPU type {t!r}; known: {', '.join(GPU_TYPES)}"
        if t in seen:
            return f"{field}[{i}]: {t!r} is listed twice"
        seen.add(t)
    return None


def node_gpu_type(gpus) -> str:
    """A node's GPU type from its GPU reports (anything with ``.name``): the type most
    of them have ("" when no name is known)."""
    counts: dict[str, int] = {}
    for g in gpus:
        t = gpu_type_of(getattr(g, "name", ""))
        if t:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: counts[t]) if counts else ""
