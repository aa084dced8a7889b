"""Reference training workload: a residual MLP classifier trained with
PyTorch over torch.distributed (gloo on CPU, NCCL on CUDA; ``--device``),
driven by the gearshift worker contract (``agent/worker.py``).

The plan comes from ``GEARSHIFT_PLAN`` and may be any plan of
``perfmodel/plans.py`` (and a few more: ZeRO also combines with TP/PP here):

- ``dp`` replicas, gradients summed over the DP group (``zero.py``);
- ``tp`` Megatron tensor parallelism: column-parallel ``up``, row-parallel
  ``down`` (``model.py``, ``parallel.py``);
- ``pp`` pipeline stages, GPipe over ``ga`` micro-batches (``schedule.py``);
- ``zero`` 1/2/3: optimizer state / + gradients / + parameters sharded over
  the DP group; ``offload``: optimizer state and step on the CPU (``zero.py``);
- ``ga`` micro-batches of ``micro_batch`` samples; ``grad_ckpt``: every
  block's activations recomputed in the backward pass.

The world size must be dp * tp * pp (ranks laid out TP fastest, then DP, PP).

Why a plan switch keeps the trajectory:
- the data stream is a function of the global sample index (``data.py``):
  step s always reads the same B samples with the same noise;
- every plan computes the gradient of the mean loss over those B samples
  (``schedule.py``), and the Adam step is elementwise;
- float64 by default, so plans that sum in a different order (DP degree, TP
  partial sums, micro-batches) differ by ~1e-16 per step instead of ~1e-7;
- the checkpoint holds the full logical state as pieces and is resharded on
  load (``ckpt.py``): model, Adam state, data position, RNG states.

Checkpoints: every ``--ckpt-every`` steps, on SIGTERM (then exit 143), on
SIGUSR1 (and go on), and at the end (``done``); each rank writes its part into
a shared temp folder, rank 0 renames it and writes the manifest last. Ranks
agree on when with one all-reduce (MAX) of the stop/checkpoint flags per step.

``GEARSHIFT_PROFILE_STEPS=n`` makes it a profiling run: ``--warmup`` steps,
then n measured steps, per-phase quantiles in the progress file, no checkpoint.

``GEARSHIFT_LOSS_LOG=path`` (testing): rank 0 appends each step's loss there.
``GEARSHIFT_HOLD_AT=s1,s2,..`` (testing, ``loadtest/switch_check``): after
reaching step s (by training, not by resuming there) every rank waits, up to
``--hold-timeout`` s, for a stop request, so a switch requested "at step s"
happens at step s however loaded the machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from gearshift.agent.worker import (
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

FORMAT = "gearshift-resharded-v1"
# what a warm worker (agent/warm.py) imports ahead of the job, then it calls warm_up()
WARM_IMPORTS = ("torch", "torch.distributed", "torch.utils.checkpoint", "numpy")


def warm_up() -> None:
    """First-use costs a warm worker pays ahead of the job: the first optimizer
    imports torch._dynamo (torch.optim's constructor, ~1 s idle, 12 s on a
    loaded box), the first backward starts autograd's machinery."""
    import torch

    w = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.Adam([w], lr=1e-3, foreach=False)
    torch.nn.functional.gelu(w @ w).sum().backward()
    opt.step()
# Profiling runs report this quantile of each phase over the measured steps
# (PhaseTimer.quantile_ms): other processes only ever add time.
PROFILE_QUANTILE = 0.25


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
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
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



class PlanError(ValueError):
    pass


def plan_shape(env: WorkerEnv, args, B: int) -> tuple[int, int, int, int, int]:
    """(dp, tp, pp, ga, micro_batch) of the plan, checked against the world size and the batch."""
    plan = env.plan
    tp, pp = int(plan.get("tp") or 1), int(plan.get("pp") or 1)
    dp = int(plan.get("dp") or max(1, env.world_size // (tp * pp)))
    ga = env.ga
    mb = int(plan.get("micro_batch") or max(1, B // (dp * ga)))
    if dp * tp * pp != env.world_size:
        raise PlanError(f"plan dp {dp} * tp {tp} * pp {pp} != world size {env.world_size}")
    if dp * ga * mb != B or args.dataset % B:
        raise PlanError(f"dp {dp} * ga {ga} * micro_batch {mb} != global batch {B} (or {B} does not divide "
                        f"the data set of {args.dataset})")
    if pp > args.layers:
        raise PlanError(f"pp {pp} > {args.layers} blocks")
    if (4 * args.hidden) % tp:
        raise PlanError(f"tp {tp} does not divide the block width {4 * args.hidden}")
    return dp, tp, pp, ga, mb


def main(argv=None) -> int:
    marks = {"main": time.time()}  # restore broken down: launch -> main -> torch imported -> rendezvous -> state
    args = parse_args(argv)
    stop = StopSignal()
    env = WorkerEnv.from_env()
    import torch
    import torch.distributed as dist
    marks["import"] = time.time()

    from gearshift.agent.reference.parallel import Comm, Layout

    torch.set_num_threads(args.threads)
    torch.set_default_dtype(getattr(torch, args.dtype))
    steps = args.steps or env.steps
    B = args.global_batch or env.global_batch
    try:
        dp, tp, pp, ga, mb = plan_shape(env, args, B)
    except PlanError as exc:
        print(f"reference workload: bad plan {env.plan}: {exc}", file=sys.stderr)
        return 2
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(0 if os.environ.get("CUDA_VISIBLE_DEVICES") else env.local_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size)
    try:
        layout = Layout(dp=dp, tp=tp, pp=pp, rank=env.rank)
        comm = Comm(dist, layout)
        marks["rendezvous"] = time.time()
        trainer = Trainer(args, env, stop, torch, dist, comm, device, steps, B, ga, mb)
        marks["state"] = time.time()
        return trainer.run(marks)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class Trainer:
    """One rank's training loop: restore, step, checkpoint, report."""

    def __init__(self, args, env, stop, torch, dist, comm, device, steps, B, ga, mb):
        from gearshift.agent.reference import ckpt
        from gearshift.agent.reference.data import dataset
        from gearshift.agent.reference.model import build_local, full_init
        from gearshift.agent.reference.zero import FlatOptimizer

        self.args, self.env, self.stop, self.torch, self.dist = args, env, stop, torch, dist
        self.comm, self.lay, self.device = comm, comm.layout, device
        self.steps, self.B, self.ga, self.mb = steps, B, ga, mb
        self.rank = env.rank
        self.profiling = env.profile_steps > 0
        self.model = build_local(args, torch, self.lay, comm).to(device)
        self.model.grad_ckpt = env.grad_ckpt
        self.opt = FlatOptimizer(torch, list(self.model.named_parameters()), comm, zero=env.zero,
                                 offload=bool(env.plan.get("offload")), lr=args.lr, device=device)
        self.writer = CheckpointWriter(env.ckpt_dir)
        self.step, self.loss_val, self.done = 0, None, False
        manifest = None if self.profiling else latest_manifest(env.ckpt_dir)
        if manifest and manifest.get("format") == FORMAT:
            meta, full = ckpt.load_full(torch, env.ckpt_dir / manifest["path"])
            self.full_shapes = {n: tuple(t["param"].shape) for n, t in full.items()}
            ckpt.restore(torch, self.opt, self.lay, full, int(meta["adam_step"]))
            ckpt.restore_rng(torch, meta, self.rank)
            self.step, self.loss_val = int(meta["step"]), meta.get("loss")
            self.done = bool(manifest.get("done")) and self.step >= steps
        else:
            init = full_init(args, torch)  # the same initial model under every plan
            self.full_shapes = {n: tuple(t.shape) for n, t in init.items()}
            ckpt.restore(torch, self.opt, self.lay, ckpt.fresh(init, torch), 0)
        X, Y = dataset(args, torch)
        self.X, self.Y = X.to(device), Y.to(device)
        # testing: rank 0 appends {"step", "loss", "generation"} per step (loadtest/switch_check)
        self.loss_log = os.environ.get("GEARSHIFT_LOSS_LOG") if self.rank == 0 and not self.profiling else None
        holds = os.environ.get("GEARSHIFT_HOLD_AT", "")
        self.holds = {int(h) for h in holds.split(",") if h.strip()}

    def label(self) -> str:
        lay, p = self.lay, self.env.plan
        return (f"pp{lay.pp} tp{lay.tp} dp{lay.dp} zero{self.env.zero}{' offload' if p.get('offload') else ''} "
                f"ga{self.ga} mb{self.mb} gc{int(self.env.grad_ckpt)}")

    def checkpoint(self, done: bool = False) -> None:
        from gearshift.agent.reference import ckpt

        t0 = time.time()
        tmp = self.writer.shared_stage(self.step, f"g{self.env.generation}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.dist.barrier()
        ckpt.save(self.torch, tmp, self.opt, self.lay, self.full_shapes,
                  {"step": self.step, "loss": self.loss_val, "seed": self.args.seed, "global_batch": self.B,
                   "samples_seen": self.step * self.B, "plan": self.env.plan}, self.dist)
        self.dist.barrier()
        if self.rank == 0:
            final = self.writer.commit(self.step, tmp)
            write_manifest(self.env.ckpt_dir, job_id=self.env.job_id, generation=self.env.generation, step=self.step,
                           done=done, fmt=FORMAT, path=final.name, loss=self.loss_val,
                           torch=self.torch.__version__, plan=self.env.plan, world_size=self.lay.world,
                           write_s=time.time() - t0, requested_at=self.stop.requested_at)
            self.writer.prune(self.step)
        self.dist.barrier()  # nobody leaves (or trains on) before the checkpoint is complete

    def hold(self, start_step: int) -> None:
        """Testing (GEARSHIFT_HOLD_AT): wait at this step for a stop request."""
        if self.step in self.holds and self.step > start_step:
            self.stop.wait(self.args.hold_timeout)

    def run(self, marks: dict | None = None) -> int:
        from gearshift.agent.reference.data import micro_batches
        from gearshift.agent.reference.schedule import train_step

        torch, dist, env, lay, args = self.torch, self.dist, self.env, self.lay, self.args
        if self.done:
            return EXIT_DONE
        steps, B = self.steps, self.B
        reporter = ProgressReporter(env.progress_file, steps=steps, min_interval=0.2)
        start_step = self.step
        ready = time.time()
        restore_s = ready - env.launched_at if env.launched_at else None
        parts = {}
        if marks and env.launched_at:  # seconds of each part of restore_s
            last = env.launched_at
            for k in ("main", "import", "rendezvous", "state"):
                parts[f"{k}_s"] = round(marks[k] - last, 3)
                last = marks[k]
        if self.rank == 0:
            print(f"{env.job_id}@{env.generation}: rank 0 of {lay.world}, plan {self.label()} on "
                  f"{self.device.type}, resuming from step {self.step} of {steps}; restore {parts}", flush=True)
        common = dict(start_step=start_step, restore_s=restore_s, restore_parts=parts)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        # profiling on a shared CPU box: CPU time of the rank's thread (see PhaseTimer)
        clock = os.environ.get("GEARSHIFT_PROFILE_CLOCK", "wall") if self.profiling else "wall"
        timer = PhaseTimer(clock)
        replay = self.profiling and clock == "cpu" and lay.pp > 1  # put the pipeline bubble back (pipeline_makespan)
        traces: list[dict] = []
        cache: dict = {}
        flags = torch.zeros(2, dtype=torch.int64, device=self.device)
        first_step_s = None
        measured = 0
        last_tick, last_tick_step = time.monotonic(), self.step
        counts = lay.last_stage and lay.tp_rank == 0  # ranks whose loss is summed
        while self.step < steps:
            # one decision for all ranks: stop/checkpoint after the same step
            flags[0], flags[1] = self.stop.flags()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self.stop.agreed(int(flags[0]), int(flags[1]))
            if self.stop.requested and not self.profiling:
                try:
                    self.checkpoint()
                except Exception as exc:
                    print(f"checkpoint failed: {exc}", file=sys.stderr, flush=True)
                    return EXIT_TEMPFAIL
                reporter.report(self.step, loss=self.loss_val, force=True, stopped=True, **common)
                return EXIT_CHECKPOINTED
            if self.stop.requested:
                return EXIT_CHECKPOINTED
            self.crash_if_asked()
            xs, ys = micro_batches(self.step, self.X, self.Y, args, torch, cache, B=B, dp=lay.dp,
                                   dp_rank=lay.dp_rank, ga=self.ga, mb=self.mb)
            timer.start_step()
            with timer("forward"):
                self.opt.gather()
            trace = {"f": [], "b": []} if replay else None
            loss = train_step(torch, self.model, self.comm, timer, xs, ys, B, args.hidden, trace)
            with timer("optimizer"):
                self.opt.step()
            if not counts:
                loss.zero_()
            dist.all_reduce(loss)
            self.loss_val = float(loss.item()) / B
            phases = timer.end_step()
            self.step += 1
            if self.loss_log:
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps({"step": self.step, "loss": self.loss_val, "generation": env.generation}) + "\n")
            if first_step_s is None:
                first_step_s = time.time() - ready
                common["first_step_s"] = first_step_s
            if self.profiling:
                measured += 1
                if trace is not None and measured > args.warmup:
                    trace["tail"] = (phases["iteration"] - phases.get("forward", 0) - phases.get("backward", 0)) / 1e3
                    traces.append(trace)
                if measured == args.warmup:
                    timer.reset()
                if measured >= args.warmup + env.profile_steps:
                    ph = timer.quantile_ms(PROFILE_QUANTILE)
                    if replay:
                        ph["iteration"] = self.replayed_ms(traces)
                    reporter.report(self.step, loss=self.loss_val, phases=ph, force=True, profiled=timer.steps,
                                    **common)
                    return EXIT_DONE
                continue
            now = time.monotonic()
            rate = (self.step - last_tick_step) * B / (now - last_tick) if now > last_tick else None
            if now - last_tick >= 1.0:
                last_tick, last_tick_step = now, self.step
            reporter.report(self.step, loss=self.loss_val, samples_per_s=rate, phases=phases,
                            force=self.step == start_step + 1 or self.step in self.holds, **common)
            if self.step < steps and (self.step % args.ckpt_every == 0 or self.stop.checkpoint_requested):
                self.checkpoint()
                self.stop.checkpoint_done()
            self.hold(start_step)
        self.checkpoint(done=True)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        if self.rank == 0:
            print(f"done: step {self.step} loss {self.loss_val!r}", flush=True)
        return EXIT_DONE

    def replayed_ms(self, traces: list[dict]) -> float:
        """The pipeline's step time from every stage's measured busy times
        (collective: every rank takes part), quantile over the steps."""
        from gearshift.agent.reference.schedule import pipeline_makespan

        lay = self.lay
        every: list = [None] * lay.world
        self.dist.all_gather_object(every, traces)
        stages = [every[lay.rank_of(s, 0, 0)] for s in range(lay.pp)]
        spans = sorted(pipeline_makespan([st[i]["f"] for st in stages], [st[i]["b"] for st in stages],
                                         [st[i]["tail"] for st in stages]) for i in range(len(traces)))
        pos = PROFILE_QUANTILE * (len(spans) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(spans) - 1)
        return (spans[lo] + (spans[hi] - spans[lo]) * (pos - lo)) * 1e3

    def crash_if_asked(self) -> None:
        if self.args.crash_at and self.step == self.args.crash_at and self.rank == 0:
            marker = self.env.ckpt_dir / f".crashed-at-{self.step}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("x")
                print(f"crashing on purpose at step {self.step}", file=sys.stderr, flush=True)
                os._exit(1)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the checkpoint and manifest are closed and renamed: skip the interpreter's slow
    # teardown of torch (part of every switch's teardown phase)
    os._exit(code)
