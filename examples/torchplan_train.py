"""Your own PyTorch model under any gearshift plan, through the plan library.

Submit it as a job (``gearshift submit`` with ``"command": ["/abs/python",
"examples/torchplan_train.py"]``): the agent sets ``GEARSHIFT_PLAN`` and the
torchrun environment, and ``torchplan.job.run`` does the rest: DP (DDP),
ZeRO-1/2/3 and offload (ZeroRedundancyOptimizer, FSDP2), TP (DTensor, with
the ``tp_plan`` below), PP (torch.distributed.pipelining, split by the layers
the ``Family`` names), GA, GC, one Distributed Checkpoint that the next plan
loads, and exit 78 (plan refused) for a plan this model cannot run.

What you write: the model, its data (indexed by sample: every plan then reads
the same samples in the same order), the loss, and where its layers are.
"""

import sys

import torch
from torch import nn

from gearshift.agent.torchplan.families import Family
from gearshift.agent.torchplan.job import Model, run
from gearshift.agent.torchplan.space import ModelShape

DIM, WIDTH, LAYERS = 16, 64, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, WIDTH), nn.Linear(WIDTH, DIM)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):  # what a plan without PP runs
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class NetLayers(Family):  # where the layers are: what PP splits and GC wraps
    def embed(self, root, x):
        return root.inp(x)

    def head(self, root, h):
        return root.out(h)


def build():
    torch.manual_seed(0)  # the same initial model on every rank
    return Net().double()


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, DIM, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


if __name__ == "__main__":
    sys.exit(run(Model(
        name="example-mlp", build=build, dataset=dataset, loss_fn=nn.functional.mse_loss,
        shape=ModelShape(family="example-mlp", layers=LAYERS, heads=WIDTH, intermediate=WIDTH),
        family=NetLayers("example-mlp", "blocks", ("inp",), ("out",), tp_plan={"up": "colwise", "down": "rowwise"}),
    ), ckpt_every=5))
