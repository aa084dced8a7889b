"""The reference workload's data: a fixed synthetic classification task
(inputs and a random teacher's labels), indexed by sample. Which samples a
step reads is the plan library's (``torchplan.data.step_indices``: a function
of the global sample index), and so is the step's input noise
(``model.step_noise``, seeded by (seed, step)): the same under every plan and
after any restart.
"""

from __future__ import annotations

import math
from typing import Any


def dataset(args: Any, torch: Any):
    """Inputs and a random teacher's labels."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset, args.dim, generator=g)
    w1 = torch.randn(args.dim, 128, generator=g) / math.sqrt(args.dim)
    w2 = torch.randn(128, args.classes, generator=g) / math.sqrt(128)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y
