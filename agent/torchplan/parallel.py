"""Apply a gearshift plan to an ``nn.Module`` with torch's own parallelism APIs.

| plan | torch API (here) |
|---|---|
| dp (zero 0) | ``DistributedDataParallel``; FSDP2 without resharding when combined with tp or pp |
| zero 1 | ``ZeroRedundancyOptimizer`` over DDP (optimizer state sharded, parameters and gradients not) |
| zero 2 / 3 | ``fully_shard`` per layer and at the top, ``reshard_after_forward`` off / on |
| offload | ``CPUOffloadPolicy`` (``pin_memory`` only on CUDA: pinning needs a GPU); under zero 1 too, as FSDP2 without resharding (``ZeroRedundancyOptimizer`` cannot offload) |
| tp | DTensor ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` per layer |
| pp | ``torch.distributed.pipelining``: a ``PipelineStage`` per rank (contiguous layers), ``ScheduleGPipe`` or ``Schedule1F1B`` over ``ga`` micro-batches |
| ga | ``no_sync`` (DDP) / ``set_requires_gradient_sync`` (FSDP2) on all but the last micro-batch |
| grad_ckpt | ``checkpoint_wrapper`` around every layer |

All of dp x tp x pp live on one ``DeviceMesh`` (dims ``pp``, ``dp``, ``tp``;
ranks laid out tp fastest). Order as torchtitan applies it: stage split, TP,
activation checkpointing, FSDP2.

PP needs the model split by layers: a ``Family`` (``families.py``; any
object with ``layers_path``, ``first_only``, ``last_only``, ``embed``,
``block``, ``head``). The stage keeps the original parameter names (its
layer list becomes a ``ModuleDict`` keyed by the layer's index), so one
Distributed Checkpoint loads under every split.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from gearshift.agent.torchplan.space import PlanRefused


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def _set(root: nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, value)


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """The contiguous layer indices of ``stage`` (earlier stages take the remainder)."""
    per, extra = divmod(n_layers, pp)
    start = stage * per + min(stage, extra)
    return list(range(start, start + per + (1 if stage < extra else 0)))


class Staged(nn.Module):
    """One pipeline stage of a layered model (the whole model when pp is 1)."""

    def __init__(self, root: nn.Module, fam: Any, first: bool, last: bool):
        super().__init__()
        self.root, self.fam, self.first, self.last = root, fam, first, last

    def layers(self) -> nn.Module:
        return _get(self.root, self.fam.layers_path)

    def forward(self, x):
        if getattr(self.fam, "whole", None) is not None:  # not split into stages (T5's two stacks)
            return self.fam.whole(self.root, x)
        h = self.fam.embed(self.root, x) if self.first else x
        for layer in self.layers().values():
            h = self.fam.block(self.root, layer, h)
        return self.fam.head(self.root, h) if self.last else h


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _style(kind: str, where: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    raise PlanRefused("tp", f"TP style {kind!r} of {where} is not supported (colwise, rowwise)")


def logits_of(out):
    return getattr(out, "logits", out)


class Parallel:
    """A model under one plan: ``train_step(xs, ys)`` trains one global step
    from this rank's ``ga`` micro-batches and returns the loss it counts."""

    def __init__(self, model: nn.Module, plan: dict, *, loss_fn: Callable, lr: float = 1e-3,
                 device: torch.device | None = None, fam: Any = None, tp_plan: dict | None = None):
        self.plan, self.loss_fn, self.device = plan, loss_fn, device or torch.device("cpu")
        dp, tp, pp, zero = plan["dp"], plan["tp"], plan["pp"], plan["zero"]
        self.ga = plan["ga"]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dp * tp * pp != world:
            raise PlanRefused("dp", f"dp {dp} * tp {tp} * pp {pp} != world size {world}")
        if (pp > 1 or plan["grad_ckpt"]) and fam is None:
            raise PlanRefused("pp" if pp > 1 else "grad_ckpt", "needs the model split by layers (a Family)")
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        rank = dist.get_rank() if world > 1 else 0
        self.pp_rank, self.dp_rank, self.tp_rank = rank // (dp * tp), (rank // tp) % dp, rank % tp
        self.counts = self.pp_rank == pp - 1 and self.tp_rank == 0  # ranks whose loss the step sums
        self.root = model
        top: nn.Module = model
        if fam is not None:
            top = self._split(model, fam, pp)
        if tp > 1:
            self._tensor_parallel(fam, tp_plan)
        if plan["grad_ckpt"]:
            self._checkpoint_layers(fam)
        self.fsdp = zero >= 2 or plan["offload"] or (dp > 1 and (tp > 1 or pp > 1))
        self.ddp = None
        if self.fsdp:
            self._fully_shard(top, fam, reshard=zero == 3, offload=plan["offload"])
        elif dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            top = self.ddp = DDP(top, process_group=self.mesh["dp"].get_group())
        self.top = top
        params = [p for p in top.parameters() if p.requires_grad]
        if zero == 1 and dp > 1 and not self.fsdp:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.zero1 = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr, foreach=False,
                                                 process_group=self.mesh["dp"].get_group())
            self.optimizer = self.zero1.optim  # this rank's partition: what its checkpoint holds
            self.stepper = self.zero1
        else:
            self.optimizer = self.stepper = torch.optim.Adam(params, lr=lr, foreach=False)
        self.schedule = self._pipeline(top, pp) if pp > 1 else None

    # ---------------------------------------------------------------- building
    def _split(self, root: nn.Module, fam: Any, pp: int) -> nn.Module:
        if getattr(fam, "whole", None) is not None:
            if pp > 1:
                raise PlanRefused("pp", f"{fam.name} cannot be split into pipeline stages: {fam.why_no_pp}")
            return Staged(root, fam, True, True)
        layers = _get(root, fam.layers_path)
        own = stage_layers(len(layers), pp, self.pp_rank)
        _set(root, fam.layers_path, nn.ModuleDict({str(i): layers[i] for i in own}))
        first, last = self.pp_rank == 0, self.pp_rank == pp - 1
        for path in (() if first else fam.first_only) + (() if last else fam.last_only):
            _set(root, path, None)
        return Staged(root, fam, first, last)

    def _layer_items(self, fam: Any) -> list[tuple[str, str, nn.Module]]:
        """(layer list path, name in it, layer) of every layer of the family (both stacks of T5)."""
        paths = fam.layer_paths() if hasattr(fam, "layer_paths") else (fam.layers_path,)
        return [(path, name, layer) for path in paths for name, layer in _get(self.root, path).named_children()]

    def _tensor_parallel(self, fam: Any, tp_plan: dict | None) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = self.mesh["tp"]
        if fam is None:
            if not tp_plan:
                raise PlanRefused("tp", "the model has no TP plan (pass tp_plan)")
            parallelize_module(self.root, tp_mesh, {k: _style(v, k) for k, v in tp_plan.items()})
            return
        if not (tp_plan or fam.tp_plan):
            raise PlanRefused("tp", f"{fam.name} has no tensor-parallel plan: {fam.why_no_tp}")
        for path, _, layer in self._layer_items(fam):
            plan = tp_plan or (fam.tp_plan_of(path) if hasattr(fam, "tp_plan_of") else fam.tp_plan)
            here = {k: v for k, v in plan.items() if _has(layer, k)}  # T5: the bias table is in block 0 only
            parallelize_module(layer, tp_mesh, {k: _style(v, k) for k, v in here.items()})
            if hasattr(fam, "after_tp"):
                fam.after_tp(layer, self.plan["tp"])

    def _checkpoint_layers(self, fam: Any) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for path, name, layer in self._layer_items(fam):
            setattr(_get(self.root, path), name, checkpoint_wrapper(layer))

    def _fully_shard(self, top: nn.Module, fam: Any, *, reshard: bool, offload: bool) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = self.mesh["dp"] if self.mesh is not None else None
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (1,))
        kw = dict(mesh=mesh, reshard_after_forward=reshard,
                  offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload else OffloadPolicy())
        if fam is not None:
            for _, _, layer in self._layer_items(fam):
                fully_shard(layer, **kw)
        fully_shard(top, **kw)

    def _pipeline(self, top: nn.Module, pp: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = self.stage = PipelineStage(top, self.pp_rank, pp, self.device, group=self.mesh["pp"].get_group())
        cls = Schedule1F1B if self.plan["pp_schedule"] == "1f1b" else ScheduleGPipe

        def loss(out, target):
            return self.loss_fn(logits_of(out), target)

        return cls(stage, n_microbatches=self.ga, loss_fn=loss)

    def time_chunks(self, clock: Callable[[], float]) -> dict:
        """Profiling a pipeline: from now on each micro-batch's forward and
        backward on this stage append their ``clock`` time to the returned
        ``{"f": [...], "b": [...]}`` (what ``profiling.pipeline_makespan`` replays)."""
        trace: dict = {"f": [], "b": []}
        for kind, name in (("f", "forward_one_chunk"), ("b", "backward_one_chunk")):
            def timed(*a, _run=getattr(self.stage, name), _kind=kind, **kw):
                t = clock()
                out = _run(*a, **kw)
                trace[_kind].append(clock() - t)
                return out

            setattr(self.stage, name, timed)
        return trace

    # ---------------------------------------------------------------- training
    def _sync(self, on: bool):
        if self.fsdp:
            self.top.set_requires_gradient_sync(on)
            return contextlib.nullcontext()
        if self.ddp is not None and not on:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def train_step(self, xs: list, ys: list, phase: Callable | None = None) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; the mean loss
        over them on a counting rank, 0 elsewhere (sum over ranks / dp = batch mean).
        ``phase(name)`` (a ``PhaseTimer``) times ``forward``, ``backward`` (with the
        gradient sync) and ``optimizer``; a pipeline's schedule interleaves them, so it
        only times ``optimizer``."""
        phase = phase or (lambda name: contextlib.nullcontext())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.schedule is not None:
            x, y = torch.cat(xs), torch.cat(ys)
            losses: list = []
            if self.pp_rank == 0:
                self.schedule.step(x, target=y if self.counts else None, losses=losses)
            elif self.pp_rank == self.plan["pp"] - 1:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            if self.counts and losses:
                total = torch.stack([lo.detach().to(torch.float64) for lo in losses]).mean()
        else:
            for k, (x, y) in enumerate(zip(xs, ys)):
                with self._sync(k == len(xs) - 1):
                    with phase("forward"):
                        loss = self.loss_fn(logits_of(self.top(x)), y) / len(xs)
                    with phase("backward"):
                        loss.backward()
                total = total + loss.detach().to(torch.float64)
        with phase("optimizer"):
            self.stepper.step()
            self.stepper.zero_grad(set_to_none=True)
        if not self.counts:
            total.zero_()
        return total
