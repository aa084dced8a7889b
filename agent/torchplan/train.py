"""A Hugging Face model trained under any plan through the plan library:
``python -m gearshift.agent.torchplan.train --model llama`` (or gpt2, bert, vit, t5).

The worker itself is ``job.run`` (the worker contract of ``agent/worker.py``:
the plan from ``GEARSHIFT_PLAN``, checkpoints on SIGTERM (exit 143) / SIGUSR1 /
every ``--ckpt-every`` steps / at the end, progress in the progress file, exit
``EXIT_PLAN_REFUSED`` (78) with one line naming the plan field for a plan the
model cannot run, before the process group forms).

Why a switch keeps the trajectory: the data stream is a function of the
global sample index (``data.step_indices``), every plan
computes the gradient of the mean loss over the step's B samples, Adam is
elementwise, float64 by default, and the checkpoint (``ckpt.py``, DCP)
reshards model and optimizer state to the new plan.
"""

from __future__ import annotations

import argparse
import os
import sys

from gearshift.agent.torchplan import families
from gearshift.agent.torchplan.job import Model, run

WARM_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "transformers")


def warm_up() -> None:
    """First-use costs a warm worker pays ahead of the job (agent/warm.py): the
    transformers model classes, the first optimizer, the first backward."""
    import torch
    import transformers  # noqa: F401  (model classes import lazily)

    for name in families.FAMILIES:
        families.build(name, layers=1)
    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.Adam([w], lr=1e-3, foreach=False)
    torch.nn.functional.gelu(w @ w).sum().backward()
    opt.step()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m gearshift.agent.torchplan.train")
    p.add_argument("--model", default="llama", help="llama, gpt2, bert, vit or t5 (tiny, from a config)")
    p.add_argument("--layers", type=int, default=families.LAYERS)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dataset", type=int, default=4096, help="samples in the synthetic token set")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--hold-timeout", type=float, default=float(os.environ.get("GEARSHIFT_HOLD_TIMEOUT", "120")))
    p.add_argument("--ckpt-every", type=int, default=int(os.environ.get("WORKER_CKPT_EVERY", "25")))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=None, help="default: $GEARSHIFT_STEPS")
    p.add_argument("--global-batch", type=int, default=None, help="default: $GEARSHIFT_GLOBAL_BATCH")
    return p.parse_args(argv)


def model_of(args) -> Model:
    name = args.model
    return Model(name=name, shape=families.shape(name, layers=args.layers), family=families.family(name),
                 build=lambda: families.build(name, seed=args.seed, dtype=args.dtype, layers=args.layers),
                 dataset=lambda: families.dataset(name, args.dataset, args.seed), loss_fn=families.loss_fn,
                 lr=args.lr, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model not in families.FAMILIES:
        print(f"torchplan: --model: unknown family {args.model!r} (one of {', '.join(families.FAMILIES)})",
              file=sys.stderr)
        return 2
    return run(model_of(args), steps=args.steps, global_batch=args.global_batch, ckpt_every=args.ckpt_every,
               threads=args.threads, hold_timeout=args.hold_timeout)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
