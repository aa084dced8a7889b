"""The plan library: any ``nn.Module`` under any gearshift plan, on torch's own APIs.

- ``space``: which plans a model can run (``check_plan``, ``plan_space``,
  ``PlanRefused`` naming the plan field); no torch import, for the scheduler side.
- ``parallel``: ``Parallel(model, plan, ...)`` applies DP/ZeRO/offload/TP/PP/GA/GC
  with DDP, ``ZeroRedundancyOptimizer``, FSDP2, DTensor and ``torch.distributed.pipelining``.
- ``ckpt``: one Distributed Checkpoint (model, optimizer, RNG per rank) plus the
  data position, loadable under any other plan and world size.
- ``families``: Hugging Face LLaMA, GPT-2, BERT, ViT and T5 built from tiny configs.
- ``data``: the step's sample indices, a function of the global sample index.
- ``profiling``: a pipeline's step time replayed from its stages' busy times.
- ``job``: the worker contract for any model (``run(Model(...))``); the reference
  workload (``agent/reference``) and ``examples/torchplan_train.py`` use it.
- ``train``: the worker (``python -m gearshift.agent.torchplan.train --model llama``).

This module imports nothing heavy: helpers to run the worker locally.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.agent.torchplan.space import ModelShape, PlanRefused, check_plan, declared_support, plan_space

__all__ = ["ModelShape", "PlanRefused", "check_plan", "declared_support", "plan_space", "command", "job_spec",
           "run_local"]

MODULE = "gearshift.agent.torchplan.train"


def command(*extra: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", MODULE, *extra]


def model_spec(family: str) -> dict[str, Any]:
    """The model as the scheduler sees it (perfmodel shape)."""
    from gearshift.agent.torchplan import families

    sh = families.shape(family)
    params = families.LAYERS * 12 * families.HIDDEN ** 2 / 1e6 + 2 * families.VOCAB * families.HIDDEN / 1e6
    return {"name": f"hf-{family}-tiny", "params": round(params, 4), "layers": sh.layers, "hidden": sh.hidden,
            "seq_len": families.SEQ, "heads": sh.heads}


def job_spec(name: str, family: str, *, steps: int, global_batch: int = 16, gpus: int = 1, plan: dict | None = None,
             extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "model": model_spec(family), "global_batch": global_batch, "steps": steps,
                            "gpus": gpus, "plan": plan or {"dp": gpus},
                            "command": command("--model", family, *extra_args), **kw}
    from gearshift.agent.torchplan import families

    support = declared_support(families.shape(family))
    if support and "plan_support" not in kw:  # what the family cannot run (GPT-2: no TP)
        spec["plan_support"] = support
    if env:
        spec["env"] = env
    return spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(cmd: list[str], plan: dict, steps: int, global_batch: int, ckpt_dir: str | os.PathLike, *,
                 env: dict[str, str] | None = None, generation: int = 1) -> list[subprocess.Popen]:
    """Start the ranks of ``cmd`` as local processes (torchrun's environment and gearshift's)."""
    world = int(plan.get("dp", 1)) * int(plan.get("tp", 1)) * int(plan.get("pp", 1))
    port = free_port()
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="torchplan-")
    procs = []
    for r in range(world):
        renv = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "GEARSHIFT_JOB_ID": "local", "GEARSHIFT_GENERATION": str(generation),
                "GEARSHIFT_PLAN": json.dumps(plan), "GEARSHIFT_CKPT_DIR": str(ckpt_dir),
                "GEARSHIFT_STEPS": str(steps), "GEARSHIFT_GLOBAL_BATCH": str(global_batch),
                "GEARSHIFT_PROGRESS_FILE": os.path.join(work, f"progress-{r}.json"),
                "GEARSHIFT_LAUNCHED_AT": repr(time.time())}
        with open(os.path.join(work, f"stderr-{r}.txt"), "w") as err:
            procs.append(subprocess.Popen(cmd, env=renv, stdout=subprocess.DEVNULL, stderr=err))
        procs[-1].stderr_path = os.path.join(work, f"stderr-{r}.txt")  # type: ignore[attr-defined]
    return procs


def run_local(family: str, plan: dict, steps: int, global_batch: int, ckpt_dir: str | os.PathLike, *,
              extra_args: tuple[str, ...] = (), timeout: float = 600, env: dict[str, str] | None = None,
              generation: int = 1) -> tuple[list[int], str]:
    """Train without the cluster; (exit codes, rank 0's stderr)."""
    procs = launch_local(command("--model", family, *extra_args), plan, steps, global_batch, ckpt_dir, env=env,
                         generation=generation)
    codes = [p.wait(timeout=timeout) for p in procs]
    return codes, Path(procs[0].stderr_path).read_text()
