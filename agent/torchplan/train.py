"""A Hugging Face model trained under any plan through the plan library:
``python -m gearshift.agent.torchplan.train --model llama`` (or gpt2, bert).

Driven by the gearshift worker contract (``agent/worker.py``): the plan from
``GEARSHIFT_PLAN``, checkpoints on SIGTERM (exit 143) / SIGUSR1 / every
``--ckpt-every`` steps / at the end, progress in the progress file. A plan the
model cannot run exits ``EXIT_PLAN_REFUSED`` (78) with one line naming the
plan field, before the process group forms.

Why a switch keeps the trajectory: the data stream is a function of the
global sample index (the reference workload's ``step_indices``), every plan
computes the gradient of the mean loss over the step's B samples, Adam is
elementwise, float64 by default, and the checkpoint (``ckpt.py``, DCP)
reshards model and optimizer state to the new plan.

Testing hooks as the reference workload's: ``GEARSHIFT_LOSS_LOG``,
``GEARSHIFT_HOLD_AT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from gearshift.agent.torchplan import families
from gearshift.agent.torchplan.space import PlanRefused, check_plan
from gearshift.agent.worker import (
    EXIT_CHECKPOINTED,
    EXIT_DONE,
    EXIT_PLAN_REFUSED,
    EXIT_TEMPFAIL,
    CheckpointWriter,
    ProgressReporter,
    StopSignal,
    WorkerEnv,
    latest_manifest,
    write_manifest,
)

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
    p.add_argument("--model", default="llama", help="llama, gpt2 or bert (tiny, from a config)")
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


def log(msg: str) -> None:
    print(f"torchplan: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    marks = {"main": time.time()}
    args = parse_args(argv)
    stop = StopSignal()
    env = WorkerEnv.from_env()
    steps = args.steps or env.steps
    B = args.global_batch or env.global_batch or 16
    try:
        shape = families.shape(args.model, layers=args.layers)
        plan = check_plan(env.plan, shape, world_size=env.world_size, global_batch=B)
        if args.dataset % B:
            raise PlanRefused("global_batch", f"{B} does not divide the data set of {args.dataset}")
    except (PlanRefused, ValueError) as exc:  # before any rank builds or trains
        print(f"torchplan: plan refused for {args.model}: {exc}", file=sys.stderr, flush=True)
        return EXIT_PLAN_REFUSED
    import torch
    import torch.distributed as dist

    marks["import"] = time.time()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                            world_size=env.world_size)
    try:
        marks["rendezvous"] = time.time()
        return Trainer(args, env, stop, plan, steps, B, marks).run()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class Trainer:
    """One rank: build, restore, step, checkpoint, report."""

    def __init__(self, args, env, stop, plan, steps, B, marks):
        import torch

        from gearshift.agent.torchplan import ckpt
        from gearshift.agent.torchplan.parallel import Parallel

        self.args, self.env, self.stop, self.plan, self.steps, self.B = args, env, stop, plan, steps, B
        self.torch, self.rank, self.marks = torch, env.rank, marks
        model = families.build(args.model, seed=args.seed, dtype=args.dtype, layers=args.layers)
        self.fingerprint = ckpt.fingerprint(args.model, model)
        fam = families.family(args.model)
        self.par = Parallel(model, plan, loss_fn=families.loss_fn, lr=args.lr, fam=fam)
        marks["build"] = time.time()
        self.writer = CheckpointWriter(env.ckpt_dir)
        self.step, self.loss_val, self.done = 0, None, False
        self.load_s = 0.0
        manifest = latest_manifest(env.ckpt_dir)
        t = time.time()
        meta = ckpt.load_latest(self.par, env.ckpt_dir, manifest, self.fingerprint,
                                log if self.rank == 0 else (lambda m: None))
        if meta is not None:
            self.load_s = time.time() - t
            self.step, self.loss_val = int(meta["step"]), meta.get("loss")
            self.done = bool(meta.get("done")) and self.step >= steps
        marks["state"] = time.time()
        self.X, self.Y = families.dataset(args.model, args.dataset, args.seed)
        self.loss_log = os.environ.get("GEARSHIFT_LOSS_LOG") if self.rank == 0 else None
        self.holds = {int(h) for h in os.environ.get("GEARSHIFT_HOLD_AT", "").split(",") if h.strip()}
        self.cache: dict = {}

    def micro_batches(self):
        from gearshift.agent.reference.data import step_indices

        p, B = self.plan, self.B
        idx = step_indices(self.step, B, self.args.dataset, self.args.seed, self.torch, self.cache)
        mb, per = p["micro_batch"], B // p["dp"]
        parts = [idx[self.par.dp_rank * per + k * mb: self.par.dp_rank * per + (k + 1) * mb] for k in range(p["ga"])]
        return [self.X[i] for i in parts], [self.Y[i] for i in parts]

    def checkpoint(self, done: bool = False) -> float:
        from gearshift.agent.torchplan import ckpt

        dist = self.torch.distributed
        t0 = time.time()
        tmp = self.writer.shared_stage(self.step, f"g{self.env.generation}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        ckpt.save(self.par, tmp, {"model": self.args.model, "fingerprint": self.fingerprint, "step": self.step,
                                  "loss": self.loss_val, "samples_seen": self.step * self.B, "done": done,
                                  "plan": self.plan, "world_size": self.env.world_size})
        dist.barrier()
        save_s = time.time() - t0
        if self.rank == 0:
            final = self.writer.commit(self.step, tmp)
            write_manifest(self.env.ckpt_dir, job_id=self.env.job_id, generation=self.env.generation, step=self.step,
                           done=done, fmt=ckpt.FORMAT, path=final.name, loss=self.loss_val, model=self.args.model,
                           plan=self.plan, world_size=self.env.world_size, write_s=time.time() - t0,
                           dcp_save_s=save_s, requested_at=self.stop.requested_at)
            self.writer.prune(self.step)
        dist.barrier()
        return save_s

    def run(self) -> int:
        torch, env = self.torch, self.env
        dist = torch.distributed
        if self.done:
            return EXIT_DONE
        reporter = ProgressReporter(env.progress_file, steps=self.steps, min_interval=0.2)
        start_step, ready = self.step, time.time()
        parts = {}
        if env.launched_at:
            last = env.launched_at
            for k in ("main", "import", "rendezvous", "build", "state"):
                parts[f"{k}_s"] = round(self.marks[k] - last, 3)
                last = self.marks[k]
            parts["dcp_load_s"] = round(self.load_s, 3)
        common = dict(start_step=start_step, restore_s=ready - env.launched_at if env.launched_at else None,
                      restore_parts=parts)
        if self.rank == 0:
            print(f"{env.job_id}@{env.generation}: {self.args.model} rank 0 of {env.world_size}, plan {self.plan}, "
                  f"resuming from step {self.step} of {self.steps}; restore {parts}", flush=True)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        flags = torch.zeros(2, dtype=torch.int64)
        last_tick, last_tick_step = time.monotonic(), self.step
        while self.step < self.steps:
            flags[0], flags[1] = self.stop.flags()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self.stop.agreed(int(flags[0]), int(flags[1]))
            if self.stop.requested:
                try:
                    save_s = self.checkpoint()
                except Exception as exc:
                    print(f"checkpoint failed: {exc}", file=sys.stderr, flush=True)
                    return EXIT_TEMPFAIL
                reporter.report(self.step, loss=self.loss_val, force=True, stopped=True, dcp_save_s=save_s, **common)
                return EXIT_CHECKPOINTED
            t = time.perf_counter()
            xs, ys = self.micro_batches()
            loss = self.par.train_step(xs, ys)
            dist.all_reduce(loss)
            self.loss_val = float(loss.item()) / self.plan["dp"]
            self.step += 1
            if self.loss_log:
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps({"step": self.step, "loss": self.loss_val, "generation": env.generation}) + "\n")
            if "first_step_s" not in common:
                common["first_step_s"] = time.time() - ready
            now = time.monotonic()
            rate = (self.step - last_tick_step) * self.B / (now - last_tick) if now > last_tick else None
            if now - last_tick >= 1.0:
                last_tick, last_tick_step = now, self.step
            reporter.report(self.step, loss=self.loss_val, samples_per_s=rate,
                            phases={"iteration": (time.perf_counter() - t) * 1e3},
                            force=self.step == start_step + 1 or self.step in self.holds, **common)
            if self.step < self.steps and (self.step % self.args.ckpt_every == 0 or self.stop.checkpoint_requested):
                self.checkpoint()
                self.stop.checkpoint_done()
            if self.step in self.holds and self.step > start_step:
                self.stop.wait(self.args.hold_timeout)
        self.checkpoint(done=True)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        if self.rank == 0:
            print(f"done: step {self.step} loss {self.loss_val!r}", flush=True)
        return EXIT_DONE


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
