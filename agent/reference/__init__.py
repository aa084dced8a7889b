"""The reference training workload (PyTorch; CPU/gloo or CUDA/NCCL; any plan): ``python -m gearshift.agent.reference.train``.

Helpers here do not import torch: a job spec that runs the workload, and an
uninterrupted local run to compare a switched run with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# The model as the scheduler sees it (perfmodel shape): ~0.9M parameters.
DIM, HIDDEN, LAYERS, CLASSES = 64, 192, 3, 10


def params_m(dim: int = DIM, hidden: int = HIDDEN, layers: int = LAYERS, classes: int = CLASSES) -> float:
    per_block = 2 * hidden + hidden * 4 * hidden + 4 * hidden + 4 * hidden * hidden + hidden
    return (dim * hidden + hidden + layers * per_block + hidden * classes + classes) / 1e6


# TP splits the blocks' 4*HIDDEN features, so any TP degree dividing them works; the
# perfmodel shape's "heads" (which TP degrees are valid) says 4: TP 1, 2 and 4.
HEADS = 4


def model_spec(name: str = "torchref") -> dict[str, Any]:
    return {"name": name, "params": round(params_m(), 4), "layers": LAYERS, "hidden": HIDDEN, "seq_len": 1,
            "heads": HEADS}


def have_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def command(*extra: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "gearshift.agent.reference.train", *extra]


def job_spec(name: str, *, steps: int, global_batch: int = 64, gpus: int = 1, plan: dict | None = None,
             extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name, "model": model_spec(), "global_batch": global_batch, "steps": steps, "gpus": gpus,
        "plan": plan or {"dp": gpus}, "command": command(*extra_args), **kw,
    }
    if env:
        spec["env"] = env
    return spec


def run_local(plan: dict, steps: int, global_batch: int, ckpt_dir: str | os.PathLike, *,
              extra_args: tuple[str, ...] = (), timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    """Train without the cluster (the ranks as local processes); returns the final manifest."""
    from gearshift.agent.torchplan import launch_local

    procs = launch_local(command(*extra_args), plan, steps, global_batch, ckpt_dir, env=env)
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"local reference run failed: exit codes {codes}")
    with open(Path(ckpt_dir) / "manifest.json") as f:
        return json.load(f)
