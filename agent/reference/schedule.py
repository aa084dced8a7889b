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


def train_step(torch: Any, model: Any, comm: Any, timer: Any, xs: list, ys: list, B: int, hidden: int,
               trace: dict | None = None):
    """Forward/backward of the micro-batches ``xs``/``ys`` (the last stage's
    labels; other stages get only the shapes); returns the summed loss of
    this rank's micro-batches (0 off the last stage). With PP and ``trace``,
    each micro-batch's forward and backward time (``timer``'s clock) are
    appended to ``trace["f"]``/``trace["b"]`` (see ``pipeline_makespan``)."""
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
    clock = timer.clock
    for x, y in zip(xs, ys):
        t0 = clock()
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
        if trace is not None:
            trace["f"].append(clock() - t0)
    for x, out in zip(ins, outs):
        t0 = clock()
        with timer("backward"):
            if lay.last_stage:
                out.backward()
            else:
                out.backward(comm.recv(torch.empty_like(out), +1))
            if not lay.first_stage:
                comm.send(x.grad, -1)
        if trace is not None:
            trace["b"].append(clock() - t0)
    return loss_sum


def pipeline_makespan(F: list[list[float]], Bk: list[list[float]], tail: list[float]) -> float:
    """Length of one GPipe step from each stage's measured busy times:
    ``F[s][k]``/``Bk[s][k]`` forward/backward of micro-batch k on stage s,
    ``tail[s]`` what stage s does after its last backward (optimizer step).
    Replays the schedule's dependencies (forward k on stage s after forward k
    on s-1 and forward k-1 on s; a stage's backwards after its forwards, in
    order, backward k after backward k on s+1), i.e. the step's critical path
    as it is when every stage has its own processor.

    Why: profiling on a shared CPU box measures thread CPU time (PhaseTimer),
    which leaves out the time a stage waits for its neighbour, the pipeline
    bubble; this puts it back from what was measured, not from a formula."""
    pp, m = len(F), len(F[0])
    fend = [[0.0] * m for _ in range(pp)]
    for s in range(pp):
        for k in range(m):
            fend[s][k] = max(fend[s - 1][k] if s else 0.0, fend[s][k - 1] if k else 0.0) + F[s][k]
    bend = [[0.0] * m for _ in range(pp)]
    for s in reversed(range(pp)):
        for k in range(m):
            prev = bend[s][k - 1] if k else fend[s][m - 1]
            bend[s][k] = max(prev, bend[s + 1][k] if s < pp - 1 else 0.0) + Bk[s][k]
    return max(bend[s][m - 1] + tail[s] for s in range(pp))
