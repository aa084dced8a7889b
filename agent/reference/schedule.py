"""One training step's forward and backward passes over the micro-batches.

Without PP a micro-batch's forward is followed by its backward (gradient
accumulation). With PP it is GPipe: every micro-batch's forward, stage to
stage (activations sent to the same (dp, tp) position of the next stage),
then every backward in the same order (gradients sent back), so the
gradients accumulate in the same order as without PP.

The loss of a micro-batch is ``sum(per-sample cross-entropy) / B`` (B the
global batch), and the DP sync sums, so every plan computes the gradient of
the mean loss over the same B samples.
"""

from __future__ import annotations

from typing import Any


def train_step(torch: Any, model: Any, comm: Any, timer: Any, xs: list, ys: list, B: int, hidden: int):
    """Forward/backward of the micro-batches ``xs``/``ys`` (the last stage's
    labels; other stages get only the shapes); returns the summed loss of
    this rank's micro-batches (0 off the last stage)."""
    F = torch.nn.functional
    lay = comm.layout
    loss_sum = torch.zeros(1, dtype=torch.float64, device=xs[0].device)
    if lay.pp == 1:
        for x, y in zip(xs, ys):
            with timer("forward"):
                loss = F.cross_entropy(model(x), y, reduction="sum")
                loss_sum += loss.detach().to(torch.float64)
            with timer("backward"):
                (loss / B).backward()
        return loss_sum
    ins, outs = [], []
    for x, y in zip(xs, ys):
        with timer("forward"):
            if not lay.first_stage:
                x = comm.recv(torch.empty(x.shape[0], hidden, device=x.device), -1).requires_grad_()
            out = model(x)
            if lay.last_stage:
                out = F.cross_entropy(out, y, reduction="sum")
                loss_sum += out.detach().to(torch.float64)
                out = out / B
            else:
                comm.send(out.detach(), +1)
            ins.append(x)
            outs.append(out)
    for x, out in zip(ins, outs):
        with timer("backward"):
            if lay.last_stage:
                out.backward()
            else:
                out.backward(comm.recv(torch.empty_like(out), +1))
            if not lay.first_stage:
                comm.send(x.grad, -1)
    return loss_sum
