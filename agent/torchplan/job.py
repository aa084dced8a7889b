"""A training job under the gearshift worker contract, for any model:
``run(Model(...))`` is a whole worker (see ``examples/torchplan_train.py``).

It checks the plan against the model (exit ``EXIT_PLAN_REFUSED`` = 78 with
one line naming the field, before the process group forms), builds the model
under the plan (``Parallel``), restores the newest good Distributed
Checkpoint, trains on the step's samples (a function of the global sample
index: the same samples in the same order under every plan), checkpoints on
SIGTERM (exit 143), SIGUSR1, every ``ckpt_every`` steps and at the end, and
reports progress (restore broken down by part, the DCP load and save among them).

``GEARSHIFT_PROFILE_STEPS=n`` makes it a profiling run (``profile``): no
checkpoint read or written, the step time's quantile reported as ``phases``.

Testing hooks: ``GEARSHIFT_LOSS_LOG`` (rank 0 appends step, loss and a hash
of the step's sample indices), ``GEARSHIFT_HOLD_AT`` (wait at those steps for
a stop request, see ``loadtest/switch_check``), ``crash_at`` (rank 0 exits 1
on reaching that step, once per checkpoint folder: a crash for the retry path).

Device: CUDA + NCCL where a GPU is visible, else CPU + gloo (``device``, or
``GEARSHIFT_DEVICE``: ``auto``, ``cpu`` or ``cuda``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from gearshift.agent.torchplan.space import ModelShape, PlanRefused, check_plan
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
    refuse_plan,
    write_manifest,
)


PROFILE_WARMUP = 2
PROFILE_QUANTILE = 0.25  # as the reference workload: other processes only ever add time


@dataclass
class Model:
    """What the job trains: ``build()`` -> nn.Module (the same init on every
    rank), ``dataset()`` -> (inputs, targets) indexed by sample, ``loss_fn(out, target)``."""

    name: str
    shape: ModelShape
    build: Callable[[], Any]
    dataset: Callable[[], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any]
    family: Any = None  # a Family (families.py): needed for pp and grad_ckpt
    tp_plan: dict | None = None  # module path -> colwise/rowwise, for a model without a Family
    lr: float = 1e-3
    seed: int = 1234
    samples: int = 0  # len(dataset); 0: read from the dataset
    # noise(step, B) -> a tensor added to the step's B inputs in global-batch order (the same under every plan)
    noise: Callable[[int, int], Any] | None = None


@dataclass
class Options:
    """How the worker runs (not what it trains)."""

    ckpt_every: int = 25
    threads: int = 1
    hold_timeout: float = 120.0
    device: str | None = None  # auto, cpu or cuda; None: $GEARSHIFT_DEVICE, else auto
    crash_at: int = 0  # testing: rank 0 exits 1 at this step, once per checkpoint folder
    warmup: int = PROFILE_WARMUP  # profiling: steps before measuring


def log(msg: str) -> None:
    print(f"torchplan: {msg}", file=sys.stderr, flush=True)


def run(model: Model, *, steps: int | None = None, global_batch: int | None = None, **options: Any) -> int:
    """The worker's exit status (``sys.exit(run(...))``); ``options``: the fields of ``Options``."""
    marks = {"main": time.time()}
    opts = Options(**options)
    stop = StopSignal()
    env = WorkerEnv.from_env()
    steps = steps or env.steps
    B = global_batch or env.global_batch or 16
    try:
        plan = check_plan(env.plan, model.shape, world_size=env.world_size, global_batch=B)
    except PlanRefused as exc:  # before any rank builds or trains
        log(f"plan refused for {model.name}: {exc}")
        return refuse_plan(env, exc.field, str(exc))
    import torch
    import torch.distributed as dist

    from gearshift.agent.torchplan.ckpt import CheckpointRefused

    marks["import"] = time.time()
    torch.set_num_threads(opts.threads)
    # CUDA + NCCL where a GPU is visible (GEARSHIFT_DEVICE=cpu forces CPU + gloo): the same code
    want = opts.device or os.environ.get("GEARSHIFT_DEVICE", "auto")
    cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(0 if os.environ.get("CUDA_VISIBLE_DEVICES") else env.local_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size)
    try:
        marks["rendezvous"] = time.time()
        try:
            job = Job(model, env, stop, plan, steps, B, marks, opts, device)
        except CheckpointRefused as exc:
            log(str(exc))
            return 1
        except PlanRefused as exc:
            log(f"plan refused for {model.name}: {exc}")
            return refuse_plan(env, exc.field, str(exc))
        return job.run()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class Job:
    """One rank: build, restore, step, checkpoint, report."""

    def __init__(self, model: Model, env, stop, plan, steps, B, marks, opts: Options, device):
        import torch

        from gearshift.agent.torchplan import ckpt
        from gearshift.agent.torchplan.parallel import Parallel

        self.model, self.env, self.stop, self.plan, self.steps, self.B = model, env, stop, plan, steps, B
        self.torch, self.rank, self.marks = torch, env.rank, marks
        self.opts, self.ckpt_every, self.hold_timeout = opts, opts.ckpt_every, opts.hold_timeout
        self.device = device
        X, Y = model.dataset()
        self.n = model.samples or len(X)
        self.X, self.Y = X.to(device), Y.to(device)
        if self.n % B:
            raise PlanRefused("global_batch", f"{B} does not divide the data set of {self.n}")
        module = model.build()
        self.fingerprint = ckpt.fingerprint(model.name, module)
        self.par = Parallel(module.to(device), plan, loss_fn=model.loss_fn, lr=model.lr, fam=model.family,
                            tp_plan=model.tp_plan, device=device)
        marks["build"] = time.time()
        self.writer = CheckpointWriter(env.ckpt_dir)
        self.step, self.loss_val, self.done, self.load_s = 0, None, False, 0.0
        t = time.time()
        self.profiling = env.profile_steps > 0  # a profiling run: from the initial model, no checkpoint
        meta = None if self.profiling else ckpt.load_latest(self.par, env.ckpt_dir, latest_manifest(env.ckpt_dir), self.fingerprint,
                                log if self.rank == 0 else (lambda m: None))
        if meta is not None:
            self.load_s = time.time() - t
            self.step, self.loss_val = int(meta["step"]), meta.get("loss")
            self.done = bool(meta.get("done")) and self.step >= steps
        marks["state"] = time.time()
        self.loss_log = os.environ.get("GEARSHIFT_LOSS_LOG") if self.rank == 0 else None
        self.holds = {int(h) for h in os.environ.get("GEARSHIFT_HOLD_AT", "").split(",") if h.strip()}
        self.cache: dict = {}
        self.samples = ""

    def micro_batches(self):
        from gearshift.agent.torchplan.data import step_indices

        p, B = self.plan, self.B
        idx = step_indices(self.step, B, self.n, self.model.seed, self.torch, self.cache)
        if self.loss_log:
            self.samples = hashlib.sha1(idx.numpy().tobytes()).hexdigest()[:12]
        mb, off = p["micro_batch"], self.par.dp_rank * (B // p["dp"])
        at = [slice(off + k * mb, off + (k + 1) * mb) for k in range(p["ga"])]
        parts = [idx[a].to(self.device) for a in at]
        xs = [self.X[i] for i in parts]
        if self.model.noise is not None:
            z = self.model.noise(self.step, B).to(self.device, self.X.dtype)
            xs = [x + z[a] for x, a in zip(xs, at)]
        return xs, [self.Y[i] for i in parts]

    def checkpoint(self, done: bool = False) -> float:
        from gearshift.agent.torchplan import ckpt

        dist = self.torch.distributed
        t0 = time.time()
        tmp = self.writer.shared_stage(self.step, f"g{self.env.generation}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        ckpt.save(self.par, tmp, {"model": self.model.name, "fingerprint": self.fingerprint, "step": self.step,
                                  "loss": self.loss_val, "samples_seen": self.step * self.B, "done": done,
                                  "plan": self.plan, "world_size": self.env.world_size})
        dist.barrier()
        save_s = time.time() - t0
        if self.rank == 0:
            final = self.writer.commit(self.step, tmp)
            write_manifest(self.env.ckpt_dir, job_id=self.env.job_id, generation=self.env.generation, step=self.step,
                           done=done, fmt=ckpt.FORMAT, path=final.name, loss=self.loss_val, model=self.model.name,
                           plan=self.plan, world_size=self.env.world_size, write_s=time.time() - t0,
                           dcp_save_s=save_s, requested_at=self.stop.requested_at)
            self.writer.prune(self.step)
        dist.barrier()
        return save_s

    def _common(self, start_step: int, ready: float) -> dict:
        env, parts = self.env, {}
        if env.launched_at:
            last = env.launched_at
            for k in ("main", "import", "rendezvous", "build", "state"):
                parts[f"{k}_s"] = round(self.marks[k] - last, 3)
                last = self.marks[k]
            parts["dcp_load_s"] = round(self.load_s, 3)
        if self.rank == 0:
            print(f"{env.job_id}@{env.generation}: {self.model.name} rank 0 of {env.world_size}, plan {self.plan}, "
                  f"resuming from step {self.step} of {self.steps}; restore {parts}", flush=True)
        return dict(start_step=start_step, restore_s=ready - env.launched_at if env.launched_at else None,
                    restore_parts=parts)

    def profile(self, reporter, common: dict) -> int:
        """``GEARSHIFT_PROFILE_STEPS=n`` (the profiler's contract): ``Options.warmup``
        steps, then n measured ones; the per-step time's quantile in the progress file
        (``iteration``, and for a plan without pp its ``forward``, ``backward`` with the
        gradient sync, and ``optimizer`` phases: what the performance model's fit reads).

        ``GEARSHIFT_PROFILE_CLOCK=cpu``: this rank's thread CPU time (what a loaded shared
        box does not inflate; it leaves out waiting on gloo's threads and a pipeline's
        bubble); a GPipe plan's ``iteration`` is then its schedule replayed on every
        stage's measured busy times (``profiling.replayed_ms``), which puts the bubble back."""
        from gearshift.agent.torchplan.profiling import replayed_ms

        clock = os.environ.get("GEARSHIFT_PROFILE_CLOCK", "wall")
        timer = PhaseTimer(clock)
        pp = self.plan["pp"]
        replay = clock == "cpu" and pp > 1 and self.plan["pp_schedule"] == "gpipe"
        trace = self.par.time_chunks(timer.clock) if replay else None
        traces: list[dict] = []
        warmup = self.opts.warmup
        for i in range(warmup + self.env.profile_steps):
            if i == warmup:
                timer.reset()
            timer.start_step()
            with timer("step"):
                xs, ys = self.micro_batches()
                loss = self.par.train_step(xs, ys, timer if pp == 1 else None)
                self.torch.distributed.all_reduce(loss)
            ms = timer.end_step()
            self.step += 1
            if trace is not None:
                if i >= warmup:
                    busy = sum(trace["f"]) + sum(trace["b"])
                    traces.append({"f": list(trace["f"]), "b": list(trace["b"]), "tail": ms["iteration"] / 1e3 - busy})
                trace["f"].clear()
                trace["b"].clear()
        ph = timer.quantile_ms(PROFILE_QUANTILE)
        ph.pop("step", None)
        if replay:
            ph["iteration"] = replayed_ms(self.torch.distributed, traces, [s * self.plan["dp"] * self.plan["tp"]
                                                                          for s in range(pp)], PROFILE_QUANTILE)
        reporter.report(self.step, loss=float(loss.item()) / self.plan["dp"], phases=ph, force=True,
                        profiled=timer.steps, **common)
        return EXIT_DONE

    def run(self) -> int:
        torch, env = self.torch, self.env
        dist = torch.distributed
        if self.done:
            return EXIT_DONE
        reporter = ProgressReporter(env.progress_file, steps=self.steps, min_interval=0.2)
        start_step, ready = self.step, time.time()
        common = self._common(start_step, ready)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        if self.profiling:
            return self.profile(reporter, common)
        flags = torch.zeros(2, dtype=torch.int64, device=self.device)
        last_tick, last_tick_step = time.monotonic(), self.step
        while self.step < self.steps:
            flags[0], flags[1] = self.stop.flags()  # one decision for all ranks
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self.stop.agreed(int(flags[0]), int(flags[1]))
            if self.stop.requested:
                try:
                    save_s = self.checkpoint()
                except Exception as exc:
                    log(f"checkpoint failed: {exc}")
                    return EXIT_TEMPFAIL
                reporter.report(self.step, loss=self.loss_val, force=True, stopped=True, dcp_save_s=save_s, **common)
                return EXIT_CHECKPOINTED
            self.crash_if_asked()
            t = time.perf_counter()
            xs, ys = self.micro_batches()
            loss = self.par.train_step(xs, ys)
            dist.all_reduce(loss)
            self.loss_val = float(loss.item()) / self.plan["dp"]
            self.step += 1
            if self.loss_log:
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps({"step": self.step, "loss": self.loss_val, "generation": env.generation,
                                        "samples": self.samples}) + "\n")
            common.setdefault("first_step_s", time.time() - ready)
            now = time.monotonic()
            rate = (self.step - last_tick_step) * self.B / (now - last_tick) if now > last_tick else None
            if now - last_tick >= 1.0:
                last_tick, last_tick_step = now, self.step
            reporter.report(self.step, loss=self.loss_val, samples_per_s=rate,
                            phases={"iteration": (time.perf_counter() - t) * 1e3},
                            force=self.step == start_step + 1 or self.step in self.holds, **common)
            if self.step < self.steps and (self.step % self.ckpt_every == 0 or self.stop.checkpoint_requested):
                self.checkpoint()
                self.stop.checkpoint_done()
            if self.step in self.holds and self.step > start_step:
                self.stop.wait(self.hold_timeout)
        self.checkpoint(done=True)
        reporter.report(self.step, loss=self.loss_val, force=True, **common)
        if self.rank == 0:
            print(f"done: step {self.step} loss {self.loss_val!r}", flush=True)
        return EXIT_DONE

    def crash_if_asked(self) -> None:
        """Testing (``Options.crash_at``): rank 0 exits 1 at that step, once per checkpoint folder."""
        at = self.opts.crash_at
        if at and self.step == at and self.rank == 0:
            marker = self.env.ckpt_dir / f".crashed-at-{self.step}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("x")
                log(f"crashing on purpose at step {self.step}")
                os._exit(1)
