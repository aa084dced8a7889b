"""Reference training workload: a residual MLP classifier (``model.py``)
trained under any gearshift plan through the plan library
(``agent/torchplan``: ``job.run`` is the whole worker).

The plan comes from ``GEARSHIFT_PLAN``; what runs it is torch's own: DP
(DDP), ZeRO-1 (``ZeroRedundancyOptimizer``), ZeRO-2/3 and offload (FSDP2,
``CPUOffloadPolicy``), TP (DTensor: ``up`` column-parallel, ``down``
row-parallel), PP (``torch.distributed.pipelining`` over the blocks, GPipe or
1F1B over ``ga`` micro-batches), GC (``checkpoint_wrapper`` per block), one
Distributed Checkpoint the next plan loads. A plan the model cannot run
(pp more than the blocks, tp not dividing ``HEADS``, offload without ZeRO,
ZeRO-1 with TP or PP, ...) exits 78 with one line naming the plan field.

Why a plan switch keeps the trajectory: the data stream is a function of the
global sample index (``torchplan.data``), the step's input noise a function of
the step (``--noise``); every plan computes the gradient of the mean loss
over the step's B samples and Adam is elementwise; float64 by default, so
plans that sum in a different order differ by ~1e-16 per step; the
checkpoint reshards model, Adam state and RNG to the new plan.

The worker contract and its hooks are the plan library's (``job.py``):
checkpoints every ``--ckpt-every`` steps, on SIGTERM (exit 143), SIGUSR1 and
at the end; ``GEARSHIFT_PROFILE_STEPS`` profiling runs (``--warmup`` steps
first; with ``GEARSHIFT_PROFILE_CLOCK=cpu`` a pipeline's step time is its
schedule replayed on the measured busy times); ``GEARSHIFT_LOSS_LOG``,
``GEARSHIFT_HOLD_AT`` (``--hold-timeout``), ``--crash-at`` /
``WORKER_CRASH_AT`` (testing); ``--device`` (CUDA + NCCL, or CPU + gloo).
"""

from __future__ import annotations

import argparse
import os
import sys

from gearshift.agent.reference import HEADS
from gearshift.agent.torchplan.families import Family
from gearshift.agent.torchplan.job import Model, run
from gearshift.agent.torchplan.space import ModelShape

NAME = "torchref"
TP_PLAN = {"up": "colwise", "down": "rowwise"}  # per block: Megatron's MLP split, as DTensor styles
# what a warm worker (agent/warm.py) imports ahead of the job, then it calls warm_up()
WARM_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
                "gearshift.agent.reference.model")


def warm_up() -> None:
    """First-use costs a warm worker pays ahead of the job: the first optimizer
    imports torch._dynamo (torch.optim's constructor, ~1 s idle, 12 s on a
    loaded box), the first backward starts autograd's machinery."""
    import torch

    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.Adam([w], lr=1e-3, foreach=False)
    torch.nn.functional.gelu(w @ w).sum().backward()
    opt.step()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m gearshift.agent.reference.train")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dim", type=int, default=64, help="input features")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=3, help="residual blocks")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dataset", type=int, default=8192, help="samples in the synthetic data set")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--noise", type=float, default=0.05, help="input noise (drawn per step, the same for every plan)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=os.environ.get("GEARSHIFT_DEVICE", "auto"),
                   help="auto: CUDA (NCCL) when a GPU is visible, else CPU (gloo)")
    p.add_argument("--hold-timeout", type=float, default=float(os.environ.get("GEARSHIFT_HOLD_TIMEOUT", "120")))
    p.add_argument("--ckpt-every", type=int, default=int(os.environ.get("WORKER_CKPT_EVERY", "25")))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=3, help="profiling: steps before measuring")
    p.add_argument("--steps", type=int, default=None, help="default: $GEARSHIFT_STEPS")
    p.add_argument("--global-batch", type=int, default=None, help="default: $GEARSHIFT_GLOBAL_BATCH")
    p.add_argument("--crash-at", type=int, default=int(os.environ.get("WORKER_CRASH_AT", "0")),
                   help="testing: exit 1 at this step, once per checkpoint folder")
    return p.parse_args(argv)


class Layers(Family):
    """Where the reference model's layers are: what PP splits and GC wraps."""

    def embed(self, root, x):
        return root.inp(x)

    def head(self, root, h):
        return root.out(h)


def shape(args) -> ModelShape:
    """What the plan checks need: PP splits the blocks, TP must divide ``HEADS``
    (the perfmodel shape's heads) and the blocks' 4 * hidden features."""
    return ModelShape(family=NAME, layers=args.layers, heads=HEADS, hidden=args.hidden, intermediate=4 * args.hidden)


def _model():
    from gearshift.agent.reference import model  # torch: imported inside run (its restore part "import")

    return model


def model_of(args) -> Model:
    return Model(name=NAME, shape=shape(args), build=lambda: _model().build(args),
                 dataset=lambda: _model().dataset(args), loss_fn=lambda out, y: _model().loss_fn(out, y),
                 family=Layers(NAME, "blocks", ("inp",), ("out",), tp_plan=dict(TP_PLAN)),
                 noise=(lambda step, B: _model().step_noise(args, step, B)) if args.noise else None,
                 lr=args.lr, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run(model_of(args), steps=args.steps, global_batch=args.global_batch, ckpt_every=args.ckpt_every,
               threads=args.threads, hold_timeout=args.hold_timeout, device=args.device, crash_at=args.crash_at,
               warmup=args.warmup)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the checkpoint and manifest are closed and renamed: skip the interpreter's slow
    # teardown of torch (part of every switch's teardown phase)
    os._exit(code)
