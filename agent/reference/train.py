"""Reference training workload: a residual MLP classifier trained with
PyTorch on CPU over torch.distributed (gloo), driven by the gearshift worker
contract (``agent/worker.py``).

The plan comes from ``GEARSHIFT_PLAN``: ``dp`` = world size (DDP), ``ga``
gradient-accumulation micro-steps (``no_sync`` on all but the last),
``micro_batch`` samples per micro-step, ``grad_ckpt`` activation
checkpointing of every block (``torch.utils.checkpoint``), ``zero >= 1``
ZeRO-1 (``ZeroRedundancyOptimizer``: optimizer state sharded over the DP
ranks). ``tp``/``pp`` > 1 are refused (exit 2).

Why a plan switch keeps the trajectory:
- fixed global batch B: every step consumes the same B samples whatever the
  plan; the order is a per-epoch permutation seeded by (seed, epoch), so
  step s always sees the same samples;
- the loss of a micro-batch is ``sum(per-sample loss) * dp / B``; DDP
  averages over dp, so every plan computes the gradient of the mean loss
  over the B samples;
- float64 by default, so the different summation orders of different
  plans differ by ~1e-16 per step instead of ~1e-7;
- checkpoints hold the full model and the full (consolidated) optimizer
  state, so they load at any DP degree, with or without ZeRO.

Checkpoints (``CheckpointWriter``: temp folder + rename, then the manifest):
every ``--ckpt-every`` steps, on SIGTERM (then exit 143), on SIGUSR1 (and
go on), and at the end (``done``). Ranks agree on when with one all-reduce
(MAX) of the stop/checkpoint flags per step.

``GEARSHIFT_PROFILE_STEPS=n`` makes it a profiling run: ``--warmup`` steps,
then n measured steps, per-phase means in the progress file, no checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from agent.worker import (
    EXIT_CHECKPOINTED,
    EXIT_DONE,
    EXIT_TEMPFAIL,
    CheckpointWriter,
    PhaseTimer,
    ProgressReporter,
    StopSignal,
    WorkerEnv,
    latest_manifest,
    write_manifest,
)

FORMAT = "torch-full"
# Profiling runs report this quantile of each phase over the measured steps
# (PhaseTimer.quantile_ms): other processes only ever add time.
PROFILE_QUANTILE = 0.25


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m agent.reference.train")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dim", type=int, default=64, help="input features")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=3, help="residual blocks")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dataset", type=int, default=8192, help="samples in the synthetic data set")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--ckpt-every", type=int, default=int(os.environ.get("WORKER_CKPT_EVERY", "25")))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=3, help="profiling: steps before measuring")
    p.add_argument("--steps", type=int, default=None, help="default: $GEARSHIFT_STEPS")
    p.add_argument("--global-batch", type=int, default=None, help="default: $GEARSHIFT_GLOBAL_BATCH")
    p.add_argument("--crash-at", type=int, default=int(os.environ.get("WORKER_CRASH_AT", "0")),
                   help="testing: exit 1 at this step, once per checkpoint folder")
    return p.parse_args(argv)


def build(args, torch):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up = nn.Linear(h, 4 * h)
            self.down = nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(args.dim, args.hidden)
            self.blocks = nn.ModuleList(Block(args.hidden) for _ in range(args.layers))
            self.out = nn.Linear(args.hidden, args.classes)
            self.grad_ckpt = False

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                if self.grad_ckpt and self.training:
                    x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                else:
                    x = b(x)
            return self.out(x)

    return Net()


def dataset(args, torch):
    """A fixed synthetic classification task: inputs and a random teacher's labels."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset, args.dim, generator=g)
    w1 = torch.randn(args.dim, 128, generator=g) / math.sqrt(args.dim)
    w2 = torch.randn(128, args.classes, generator=g) / math.sqrt(128)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def step_indices(step: int, B: int, n: int, seed: int, torch, cache: dict):
    """The B sample indices of ``step`` (0-based), the same under every plan."""
    start = step * B
    epoch, off = divmod(start, n)
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    perm = cache[epoch]
    if off + B > n:
        raise ValueError("global batch must divide the data set size")
    return perm[off: off + B]


def main(argv=None) -> int:
    args = parse_args(argv)
    stop = StopSignal()
    env = WorkerEnv.from_env()
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    torch.set_default_dtype(getattr(torch, args.dtype))
    steps = args.steps or env.steps
    B = args.global_batch or env.global_batch
    plan = env.plan
    if int(plan.get("tp") or 1) != 1 or int(plan.get("pp") or 1) != 1:
        print(f"reference workload: tp/pp not supported (plan {plan})", file=sys.stderr)
        return 2
    dp, ga = env.world_size, env.ga
    mb = env.micro_batch if plan else B // dp
    if dp * ga * mb != B or args.dataset % B:
        print(f"reference workload: dp {dp} * ga {ga} * micro_batch {mb} != global batch {B} "
              f"(or {B} does not divide {args.dataset})", file=sys.stderr)
        return 2
    rank = env.rank
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=rank, world_size=dp)
    try:
        return train(args, env, stop, torch, dist, DDP, ZeroRedundancyOptimizer, steps, B, dp, ga, mb, rank)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def train(args, env, stop, torch, dist, DDP, ZeroRedundancyOptimizer, steps, B, dp, ga, mb, rank) -> int:
    torch.manual_seed(args.seed)
    net = build(args, torch)
    net.grad_ckpt = env.grad_ckpt
    model = DDP(net)
    zero = env.zero >= 1 and dp > 1
    if zero:
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    X, Y = dataset(args, torch)
    writer = CheckpointWriter(env.ckpt_dir)
    reporter = ProgressReporter(env.progress_file, steps=steps, min_interval=0.2)
    profiling = env.profile_steps > 0

    step, loss_val = 0, None
    manifest = None if profiling else latest_manifest(env.ckpt_dir)
    if manifest and manifest.get("format") == FORMAT:
        state = torch.load(os.path.join(env.ckpt_dir, manifest["path"], "state.pt"), map_location="cpu",
                           weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, loss_val = int(state["step"]), state.get("loss")
        if manifest.get("done") and step >= steps:
            return EXIT_DONE
    start_step = step
    ready = time.time()
    restore_s = ready - env.launched_at if env.launched_at else None
    if rank == 0:
        print(f"{env.job_id}@{env.generation}: rank 0 of {dp}, plan dp{dp} ga{ga} mb{mb} "
              f"gc{int(env.grad_ckpt)} zero{int(zero)}, resuming at step {step}/{steps}", flush=True)
    reporter.report(step, loss=loss_val, force=True, start_step=start_step, restore_s=restore_s)

    def checkpoint(done: bool = False) -> None:
        t0 = time.time()
        if zero:
            opt.consolidate_state_dict(to=0)  # collective: every rank takes part
        if rank == 0:
            with writer.stage(step) as tmp:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step,
                            "loss": loss_val}, os.path.join(tmp, "state.pt"))
            write_manifest(env.ckpt_dir, job_id=env.job_id, generation=env.generation, step=step, done=done,
                           fmt=FORMAT, path=writer.path(step).name, loss=loss_val, torch=torch.__version__,
                           plan=env.plan, world_size=dp, write_s=time.time() - t0,
                           requested_at=stop.requested_at)
            writer.prune(step)
        dist.barrier()  # nobody leaves (or trains on) before the checkpoint is complete

    # profiling on a shared CPU box: CPU time of the rank's thread (see PhaseTimer)
    timer = PhaseTimer(os.environ.get("GEARSHIFT_PROFILE_CLOCK", "wall") if profiling else "wall")
    cache: dict = {}
    flags = torch.zeros(2, dtype=torch.int64)
    loss_acc = torch.zeros(1, dtype=torch.float64)
    first_step_s = None
    measured = 0
    last_tick, last_tick_step = time.monotonic(), step
    while step < steps:
        # one decision for all ranks: stop/checkpoint after the same step
        flags[0], flags[1] = stop.flags()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop.agreed(int(flags[0]), int(flags[1]))
        if stop.requested and not profiling:
            try:
                checkpoint()
            except Exception as exc:
                print(f"checkpoint failed: {exc}", file=sys.stderr, flush=True)
                return EXIT_TEMPFAIL
            reporter.report(step, loss=loss_val, force=True, start_step=start_step, restore_s=restore_s,
                            first_step_s=first_step_s, stopped=True)
            return EXIT_CHECKPOINTED
        if stop.requested:
            return EXIT_CHECKPOINTED
        if args.crash_at and step == args.crash_at and rank == 0:
            marker = env.ckpt_dir / f".crashed-at-{step}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("x")
                print(f"crashing on purpose at step {step}", file=sys.stderr, flush=True)
                os._exit(1)

        idx = step_indices(step, B, args.dataset, args.seed, torch, cache)
        mine = idx[rank * (B // dp): (rank + 1) * (B // dp)]
        timer.start_step()
        loss_acc.zero_()
        for k in range(ga):
            part = mine[k * mb: (k + 1) * mb]
            x, y = X[part], Y[part]
            ctx = model.no_sync() if k < ga - 1 else _null()
            with ctx:
                with timer("forward"):
                    out = model(x)
                    loss = torch.nn.functional.cross_entropy(out, y, reduction="sum")
                    loss_acc += loss.detach().to(torch.float64)
                with timer("backward"):
                    (loss * (dp / B)).backward()
        with timer("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_acc)
        loss_val = float(loss_acc.item()) / B
        phases = timer.end_step()
        step += 1
        if first_step_s is None:
            first_step_s = time.time() - ready
        if profiling:
            measured += 1
            if measured == args.warmup:
                timer.reset()
            if measured >= args.warmup + env.profile_steps:
                reporter.report(step, loss=loss_val, phases=timer.quantile_ms(PROFILE_QUANTILE), force=True, profiled=timer.steps,
                                start_step=start_step, restore_s=restore_s, first_step_s=first_step_s)
                return EXIT_DONE
            continue
        now = time.monotonic()
        rate = (step - last_tick_step) * B / (now - last_tick) if now > last_tick else None
        if now - last_tick >= 1.0:
            last_tick, last_tick_step = now, step
        reporter.report(step, loss=loss_val, samples_per_s=rate, phases=phases, force=step == start_step + 1,
                        start_step=start_step, restore_s=restore_s, first_step_s=first_step_s)
        if step < steps and (step % args.ckpt_every == 0 or stop.checkpoint_requested):
            checkpoint()
            stop.checkpoint_done()
    checkpoint(done=True)
    reporter.report(step, loss=loss_val, force=True, start_step=start_step, restore_s=restore_s,
                    first_step_s=first_step_s)
    if rank == 0:
        print(f"done: step {step} loss {loss_val!r}", flush=True)
    return EXIT_DONE


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
