"""Data-parallel gradient sync and the Adam step, with ZeRO stages 0-3 and CPU offload.

All of this rank's parameters live as views into one flat buffer (padded to a
multiple of the DP degree). The optimizer (``torch.optim.Adam``) owns one flat
"master" tensor: the whole buffer at ZeRO 0, this DP rank's shard at ZeRO >= 1
(ZeRO-1: optimizer state sharded), on the CPU with ``offload``.

- stage 0/1: gradients all-reduced over the DP group;
- stage 2/3: gradients reduce-scattered (each rank keeps only its shard);
- stage >= 1: after the step, the updated shards are all-gathered;
- stage 3: between steps the full buffer is freed (its storage resized to 0)
  and only the shard (the master) is kept; ``gather()`` rebuilds it before
  the forward pass. (One gather per step for the whole stage, not per layer:
  the model is tiny; a per-layer gather changes when, not what, is moved.)

Why our own flat buffer and not ``ZeroRedundancyOptimizer``/FSDP: the same few
lines give every stage and offload on gloo and NCCL alike, the arithmetic is
elementwise Adam on the same numbers whatever the sharding (so a ZeRO-stage
switch keeps the loss to 1e-12), and the checkpoint can name every element
(``pieces``), which is what resharding on load needs.
"""

from __future__ import annotations

from typing import Any


class FlatOptimizer:
    def __init__(self, torch: Any, named_params: list[tuple[str, Any]], comm: Any, *, zero: int, offload: bool,
                 lr: float, device: Any):
        self.torch, self.comm = torch, comm
        self.zero, self.offload = zero, offload
        lay = comm.layout
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        shards = lay.dp if zero >= 1 else 1
        self.padded = -(-n // shards) * shards
        self.shard = self.padded // shards
        self.lo = (lay.dp_rank if zero >= 1 else 0) * self.shard
        self.flat = torch.zeros(self.padded, device=device)
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[o:o + p.numel()].view(p.shape)
        opt_device = "cpu" if offload else device
        self.master = torch.nn.Parameter(self.flat[self.lo:self.lo + self.shard].detach().clone().to(opt_device))
        self.opt = torch.optim.Adam([self.master], lr=lr, foreach=False)

    # ---------------------------------------------------------------- params
    def gather(self) -> None:
        """Full parameters in place before the forward pass (ZeRO-3 only has work)."""
        if self.zero < 3:
            return
        st = self.flat.untyped_storage()
        st.resize_(self.padded * self.flat.element_size())
        self._publish()

    def release(self) -> None:
        """After the gradients are taken: ZeRO-3 frees the full parameters."""
        if self.zero >= 3:
            self.flat.untyped_storage().resize_(0)

    def _publish(self) -> None:
        shard = self.flat[self.lo:self.lo + self.shard]
        shard.copy_(self.master.detach().to(shard.device))
        if self.zero >= 1:
            self.comm.dp_all_gather(self.flat, shard.clone())

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        torch = self.torch
        g = torch.zeros(self.padded, device=self.flat.device)
        for p, o in zip(self.params, self.offsets):
            if p.grad is not None:
                g[o:o + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        if self.zero >= 2:
            gs = torch.empty(self.shard, device=g.device)
            self.comm.dp_reduce_scatter(gs, g)
        else:
            self.comm.dp_all_reduce(g)
            gs = g[self.lo:self.lo + self.shard]
        self.release()
        self.master.grad = gs.to(self.master.device)
        self.opt.step()
        self.master.grad = None
        if self.zero < 3:
            self._publish()

    # ---------------------------------------------------------------- checkpoint pieces
    def state(self) -> dict[str, Any]:
        """Flat (shard) tensors: param, exp_avg, exp_avg_sq; and the Adam step count."""
        st = self.opt.state.get(self.master) or {}
        zeros = self.torch.zeros_like(self.master.detach())
        return {"param": self.master.detach(), "exp_avg": st.get("exp_avg", zeros),
                "exp_avg_sq": st.get("exp_avg_sq", zeros), "adam_step": int(st["step"]) if "step" in st else 0}

    def load(self, flat: dict[str, Any], adam_step: int) -> None:
        """Set this rank's shard (flat tensors over the whole local buffer) and publish the parameters."""
        torch = self.torch
        sl = slice(self.lo, self.lo + self.shard)
        with torch.no_grad():
            self.master.copy_(flat["param"][sl])
        if adam_step:
            dev = self.master.device
            self.opt.state[self.master] = {
                "step": torch.tensor(float(adam_step), dtype=torch.get_default_dtype()),
                "exp_avg": flat["exp_avg"][sl].clone().to(dev), "exp_avg_sq": flat["exp_avg_sq"][sl].clone().to(dev)}
        self.flat.copy_(flat["param"].to(self.flat.device))  # every rank has the whole local buffer: no gather
        self.release()

    def ranges(self):
        """(name, param, flat start, flat stop) of this rank's shard, per parameter it touches."""
        hi = self.lo + self.shard
        for name, p, o in zip(self.names, self.params, self.offsets):
            a, b = max(o, self.lo), min(o + p.numel(), hi)
            if a < b:
                yield name, p, a - o, b - o, a - self.lo
