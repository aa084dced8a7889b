"""A Hugging Face ``transformers.Trainer`` job under gearshift (issue 20 item 7).

The Trainer stays the user's: a tiny ``LlamaForCausalLM`` built from a config
(no download), ``TrainingArguments`` and ``trainer.train``. What gearshift
needs is one ``TrainerCallback`` (``Gearshift`` below) and a few lines around
``train``:

- the plan: ``GEARSHIFT_PLAN`` sets the data-parallel degree (the torchrun
  environment the agent gives every rank: DDP over gloo, or NCCL on a GPU),
  ``per_device_train_batch_size`` (the micro-batch), ``gradient_accumulation_steps``
  and ``gradient_checkpointing``. Plans the Trainer cannot run here (tp, pp,
  ZeRO, offload) exit 78 before torch is imported (``agent.worker.refuse_plan``,
  naming the field); the job spec declares the same in ``plan_support``
  (``--spec`` prints it), so ``gearshift reconfigure`` refuses them up front;
- SIGTERM (a switch or a preemption): the ranks agree on it with an all-reduce
  after each logged step, the Trainer saves its checkpoint at that same step
  on every rank, and the process exits 143; SIGUSR1 saves and keeps training;
- the checkpoint is the Trainer's own ``checkpoint-<step>`` folder (model,
  optimizer, scheduler, RNG per rank, trainer state). Once it is complete,
  rank 0 adds ``gearshift.json`` (the model's fingerprint and a checksum of
  every file) and then the ``manifest.json`` the agent reads;
- on start it resumes (``resume_from_checkpoint``) from the newest good
  checkpoint: one of another model or a corrupt one is skipped with one line,
  falling back to the last good one. Under another DP degree or GA the
  Trainer's seeded sampler and batch skipping give the same samples per step
  (the global batch is fixed), so the loss continues;
- progress (step, loss, samples/s) goes to ``GEARSHIFT_PROGRESS_FILE``;
  ``GEARSHIFT_PROFILE_STEPS=n`` makes it a profiling run (the step time, no
  checkpoint).

Submit it: ``python examples/hf_trainer_train.py --spec --gpus 2 --steps 40 |
gearshift submit -``. Testing hooks, as ``agent/torchplan/job.py``:
``GEARSHIFT_LOSS_LOG`` (rank 0 appends step and loss), ``GEARSHIFT_HOLD_AT``
(wait at those steps for a stop request).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gearshift.agent.worker import (
    EXIT_CHECKPOINTED,
    EXIT_DONE,
    PhaseTimer,
    ProgressReporter,
    StopSignal,
    WorkerEnv,
    latest_manifest,
    read_json,
    refuse_plan,
    write_json_atomic,
    write_manifest,
)

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ, SAMPLES, SEED = 64, 32, 2, 4, 2, 16, 512, 1234
NAME = "hf-trainer-llama-tiny"
FORMAT, META = "gearshift-hf-trainer-v1", "gearshift.json"
#: what the Trainer runs here: DP (DDP), GA, GC and the micro-batch; the job spec declares it
PLAN_SUPPORT = {"tp": [1], "pp": [1], "zero": [0], "offload": False}
PROFILE_WARMUP = 2


def log(msg: str) -> None:
    print(f"hf_trainer: {msg}", file=sys.stderr, flush=True)


def job_spec(*, gpus: int = 1, steps: int = 40, global_batch: int = 16, name: str = "hf-trainer") -> dict:
    """What ``gearshift submit`` takes: the model's shape, so admission and
    ``reconfigure`` refuse what it cannot run, and the plans the Trainer supports."""
    params = (VOCAB * HIDDEN * 2 + LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS
                                             + 3 * HIDDEN * 2 * HIDDEN)) / 1e6
    return {"name": name, "model": {"name": NAME, "params": round(params, 4), "layers": LAYERS, "hidden": HIDDEN,
                                    "seq_len": SEQ, "heads": HEADS, "kv_heads": KV_HEADS},
            "global_batch": global_batch, "steps": steps, "gpus": gpus, "plan": {"dp": gpus},
            "plan_support": PLAN_SUPPORT, "command": [sys.executable, str(Path(__file__).resolve())]}


def plan_refused(env: WorkerEnv) -> tuple[str, str] | None:
    """(plan field, reason) for a plan this script cannot run; no torch import."""
    from gearshift.bus_schema import codec
    from gearshift.bus_schema.messages import Plan, PlanSupport
    from gearshift.bus_schema.plan_support import plan_refusal

    try:
        plan = codec.convert(env.plan, Plan)
    except Exception as exc:  # a malformed GEARSHIFT_PLAN
        return "plan", f"GEARSHIFT_PLAN is not a plan: {exc}"
    got = plan_refusal(codec.convert(PLAN_SUPPORT, PlanSupport), plan)
    if got is not None:
        return got[0].removeprefix("plan_support."), f"the Trainer example runs DP, GA and GC only: {got[1]}"
    if plan.dp != env.world_size:
        return "dp", f"dp {plan.dp} differs from the {env.world_size} ranks launched"
    if env.global_batch % (plan.dp * plan.ga):
        return "ga", f"dp {plan.dp} * ga {plan.ga} does not divide the global batch {env.global_batch}"
    return None


# ------------------------------------------------------------------ checkpoints
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def seal(folder: Path, fingerprint: str, step: int) -> None:
    """Rank 0, after every rank's part of ``folder`` is written: what ``check`` verifies."""
    files = {p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != META}
    write_json_atomic(folder / META, {"format": FORMAT, "model": NAME, "fingerprint": fingerprint, "step": step,
                                      "files": files})


def check(folder: Path, fingerprint: str) -> str | None:
    """Why ``folder`` cannot be resumed from (one line), or None when it can."""
    meta = read_json(folder / META)
    if meta is None:
        return f"checkpoint {folder.name}: incomplete (no {META})"
    if meta.get("format") != FORMAT:
        return f"checkpoint {folder.name}: format {meta.get('format')!r}, not {FORMAT}"
    if meta.get("fingerprint") != fingerprint:
        return (f"checkpoint {folder.name}: another model ({meta.get('model')} fingerprint "
                f"{meta.get('fingerprint')}, this job's is {fingerprint})")
    for name, want in sorted((meta.get("files") or {}).items()):
        p = folder / name
        if not p.is_file() or _digest(p) != want:
            return f"checkpoint {folder.name}: corrupt ({name} {'missing' if not p.is_file() else 'changed'})"
    return None


def newest_good(ckpt_dir: Path, fingerprint: str) -> tuple[Path | None, int]:
    """The newest checkpoint to resume from (the manifest's first, then older
    ``checkpoint-<n>`` folders), and how many were refused (each with a line)."""
    manifest = latest_manifest(ckpt_dir)
    tried: list[Path] = []
    if manifest and manifest.get("format") == FORMAT and manifest.get("path"):
        tried.append(ckpt_dir / manifest["path"])
    folders = [p for p in ckpt_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    tried += [p for p in sorted(folders, key=lambda p: -int(p.name.split("-")[-1])) if p not in tried]
    refused = 0
    for folder in tried:
        why = check(folder, fingerprint)
        if why is None:
            return folder, refused
        refused += 1
        if int(os.environ.get("RANK", "0")) == 0:
            log(f"refused {why}")
    return None, refused


# ------------------------------------------------------------------ model and data
def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
                      attn_implementation="eager")
    torch.manual_seed(SEED)  # the same initial model on every rank
    return LlamaForCausalLM(cfg).to(torch.float64)  # float64: a plan change leaves the loss to ~1e-12


def dataset():
    import torch

    g = torch.Generator().manual_seed(SEED)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    stride = torch.randint(1, 4, (SAMPLES, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB  # learnable sequences

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    return Tokens()


# ------------------------------------------------------------------ the callback
def make_callback(env: WorkerEnv, stop: StopSignal, fingerprint: str, start_step: int, profiling: bool):
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Gearshift(TrainerCallback):
        """Worker protocol inside the Trainer: progress, agreed stop, sealed checkpoints."""

        def __init__(self):
            self.reporter = ProgressReporter(env.progress_file, steps=env.steps, min_interval=0.2)
            self.timer = PhaseTimer()
            self.stopped = False
            self.loss_log = os.environ.get("GEARSHIFT_LOSS_LOG") if env.rank == 0 else None
            self.holds = {int(h) for h in os.environ.get("GEARSHIFT_HOLD_AT", "").split(",") if h.strip()}
            self.hold_timeout = float(os.environ.get("GEARSHIFT_HOLD_TIMEOUT") or 120)
            self.last = (time.monotonic(), start_step)

        def on_step_begin(self, args, state, control, **kw):
            self.timer.start_step()

        def on_step_end(self, args, state, control, **kw):
            self.timer.end_step()
            if profiling and state.global_step == PROFILE_WARMUP:  # measure the steps after the warm-up
                self.timer.reset()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs or profiling:
                return
            step, loss = state.global_step, float(logs["loss"])
            if self.loss_log:
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "generation": env.generation}) + "\n")
            now, (t0, s0) = time.monotonic(), self.last
            rate = (step - s0) * env.global_batch / (now - t0) if now > t0 and step > s0 else None
            self.last = (now, step) if now - t0 >= 1.0 else self.last
            self.reporter.report(step, loss=loss, samples_per_s=rate, start_step=start_step,
                                 phases={"iteration": self.timer.history[-1]["iteration"] * 1e3},
                                 force=step == start_step + 1 or step in self.holds)
            if step in self.holds and step > start_step:
                stop.wait(self.hold_timeout)
            flags = torch.tensor(stop.flags(), dtype=torch.int64, device=args.device)
            if dist.is_initialized():  # one decision for all ranks: every one saves after this step
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop.agreed(int(flags[0]), int(flags[1]))
            if stop.requested or stop.checkpoint_requested or step >= state.max_steps:
                control.should_save = True
            if stop.requested and step < state.max_steps:
                control.should_training_stop = self.stopped = True

        def on_save(self, args, state, control, **kw):
            if dist.is_initialized():
                dist.barrier()  # every rank's RNG state is on disk
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if env.rank == 0:
                seal(folder, fingerprint, state.global_step)
                write_manifest(env.ckpt_dir, job_id=env.job_id, generation=env.generation, step=state.global_step,
                               done=state.global_step >= state.max_steps, fmt=FORMAT, path=folder.name,
                               model=NAME, plan=env.plan, world_size=env.world_size,
                               requested_at=stop.requested_at)
            stop.checkpoint_done()
            if dist.is_initialized():
                dist.barrier()

    return Gearshift()


def train(env: WorkerEnv, stop: StopSignal, ckpt_every: int) -> int:
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import set_seed
    from transformers.utils import logging as hf_logging

    from gearshift.agent.torchplan.ckpt import fingerprint as model_fingerprint

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    cuda = torch.cuda.is_available() and os.environ.get("GEARSHIFT_DEVICE", "auto") != "cpu"
    profiling = env.profile_steps > 0
    model = build()
    fingerprint = model_fingerprint(NAME, model)
    resume, refused = (None, 0) if profiling else newest_good(env.ckpt_dir, fingerprint)
    if resume is None and refused:
        log(f"no good checkpoint in {env.ckpt_dir} ({refused} refused)")
        return 1
    start = int((read_json(resume / "trainer_state.json") or {}).get("global_step", 0)) if resume else 0
    steps = PROFILE_WARMUP + env.profile_steps if profiling else env.steps
    out = tempfile.mkdtemp(prefix="hf-profile-") if profiling else str(env.ckpt_dir)
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=env.micro_batch,
        gradient_accumulation_steps=env.ga, activation_checkpointing=env.grad_ckpt,
        activation_checkpointing_kwargs={"use_reentrant": False}, learning_rate=1e-3, lr_scheduler_type="constant",
        weight_decay=0.0, logging_steps=1, save_strategy="no" if profiling else "steps", save_steps=ckpt_every,
        save_total_limit=2, report_to="none", seed=SEED, data_seed=SEED, dataloader_drop_last=True,
        ddp_backend=("nccl" if cuda else "gloo") if env.world_size > 1 else None, use_cpu=not cuda,
        ddp_find_unused_parameters=False,
        disable_tqdm=True, log_level="warning")
    set_seed(SEED)
    callback = make_callback(env, stop, fingerprint, start, profiling)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback])
    if env.rank == 0:
        print(f"{env.job_id}@{env.generation}: {NAME} under {env.plan} on {env.world_size} ranks, resuming from "
              f"{resume.name if resume else 'scratch'}", flush=True)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if profiling:  # the step time's lower quartile (other processes only ever add time), no checkpoint
        shutil.rmtree(out, ignore_errors=True)
        callback.reporter.report(steps, phases=callback.timer.quantile_ms(0.25), profiled=callback.timer.steps,
                                 force=True)
        return EXIT_DONE
    callback.reporter.report(trainer.state.global_step, loss=trainer.state.log_history[-1].get("train_loss") if not callback.stopped
                             else None, force=True, stopped=callback.stopped, start_step=start)
    return EXIT_CHECKPOINTED if callback.stopped else EXIT_DONE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="store_true", help="print a job spec for `gearshift submit -` and exit")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=4)
    a = ap.parse_args(argv)
    if a.spec:
        print(json.dumps(job_spec(gpus=a.gpus, steps=a.steps, global_batch=a.global_batch)))
        return 0
    stop = StopSignal()
    env = WorkerEnv.from_env()
    got = plan_refused(env)
    if got is not None:  # before torch is imported or any rank joins
        log(f"plan refused: {got[0]}: {got[1]}")
        return refuse_plan(env, *got)
    try:
        return train(env, stop, a.ckpt_every)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
